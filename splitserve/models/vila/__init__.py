"""VILA1.5: model.py (SigLIP tower, mlp_downsample projector, decoder, part-folder weights),
processor.py (the front's hooks), config.py (the part folders' configs as one). Empty on purpose:
importing the processor or the config reader must not import the model."""
