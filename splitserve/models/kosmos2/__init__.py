"""Kosmos-2: model.py (ViT, latent-query resampler, decoder), processor.py (the front's prompt layout,
image runs and grounding post-processing). Empty on purpose: importing the processor must not import
the model."""
