"""T5 / Flan-T5 (models/t5/model.py)."""
