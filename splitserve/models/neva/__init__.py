"""NeVA / Video NeVA: model.py (CLIP tower, projector, Nemotron decoder, NeMo weight names),
processor.py (the front's prompt, image and video hooks); the .nemo conversion and config reader are
loading/neva_nemo.py. Empty on purpose: importing the processor must not import the model."""
