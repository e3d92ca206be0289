"""BLIP-2 with a Flan-T5 language model (model.py)."""
