"""One subpackage per parallel dimension, each with one entry point that
:func:`lightning_para.parallelize.parallelize` calls in a fixed order:

* :mod:`.pipeline` -- ``apply_pipeline_parallel`` (split into stages, run schedules);
* :mod:`.tensor` -- ``apply_tensor_parallel`` (TP + sequence parallel from a plan);
* :mod:`.expert` -- ``apply_expert_parallel`` (experts over ``ep``, all-to-all dispatch);
* :mod:`.activation_checkpoint` -- ``apply_activation_checkpointing``;
* :mod:`.compile` -- ``apply_compile`` (``torch.compile`` per block, after recomputation);
* :mod:`.data` -- ``ZeroDataParallel`` (ZeRO 0-2) and ``apply_fully_shard`` (ZeRO-3, FSDP2).
"""
