"""How parameters are updated: AdamW (whole, or ZeRO-1) and the learning-rate schedules with every part's optimizer
stepped and checkpointed as one (optimizers.py), Muon (muon.py) and QK-clip (qk_clip.py). The batch ramp's position
of the LR schedule in tokens is the ramp's own (data/ramp.py: BatchRamp.schedule_position)."""
