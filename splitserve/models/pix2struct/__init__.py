"""Pix2Struct / Deplot: the model (model.py) and its front-side processor (processor.py)."""
