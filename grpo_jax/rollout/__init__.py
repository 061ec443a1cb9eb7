"""Generating groups: the static sampler and the continuous engine, the actor thread that turns
handouts into scored groups, and the weight sync that reshards the learner's weights onto the actor."""
