"""BLIP-2: model.py (ViT, Q-Former, projection; the OPT variant; the T5 variant is models/blip2_t5.py),
processor.py (the front's hooks, shared by both). Empty on purpose: importing the processor must not
import the model."""
