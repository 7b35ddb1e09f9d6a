"""The parameters and the physics: one configuration's step time, memory and cost."""
