"""The signatures of megatron-core's forward-backward schedules, which several features wrap."""

_COMMON = (
    "(*, forward_step_func, data_iterator, model, num_microbatches, seq_length, micro_batch_size, "
    "decoder_seq_length=None, forward_only=False, collect_non_loss_data=False, first_val_step=None, "
    "adjust_tensor_shapes_fn=None, "
)
#: The schedules' keyword-only signatures: 0.16 added ``force_all_reduce`` (and ``p2p_communicator`` to the
#: no-pipelining schedule, which 0.15's pipelined schedules already took).
SCHEDULE = _COMMON + "p2p_communicator=None, pg_collection=None, force_all_reduce=False)"
SCHEDULE_0_15 = _COMMON + "p2p_communicator=None, pg_collection=None)"
NO_PIPELINING_0_15 = _COMMON + "pg_collection=None)"

