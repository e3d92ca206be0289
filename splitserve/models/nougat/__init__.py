"""Nougat: the model (model.py), its Swin encoder (swin.py) and its front-side processor (processor.py)."""
