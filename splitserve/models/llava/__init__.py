"""LLaVA-1.5 and LLaVA-NeXT: model.py (vision tower, projector, decoder), processor.py (the front's
hooks: image token counts). Empty on purpose: importing the processor must not import the model."""
