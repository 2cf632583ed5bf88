"""The contract between the engine (``pagedray.cluster``) and the TP workers: the engine configuration,
sampling parameters and the wire types of a step (StepPlan in, StepResult out, msgpack on the wire).

Both sides import these modules, and these modules import nothing else of pagedray, so the layers
point one way: deploy -> cluster -> workers -> kernels (block_manager beside them).
``pagedray.cluster`` re-exports the configs and ``SamplingParams`` as its public API.
"""
