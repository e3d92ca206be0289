"""Phi-3-vision: model.py (CLIP tower, HD merge, projector, decoder), processor.py (the front's HD-crop
image processor and prompt hooks), config.py (its config.json). Empty on purpose: importing the
processor or the config reader must not import the model."""
