"""Runtime: target and drafter models, caches with rollback, the DFlash decoding loop, sampling.

Public API (importing this package imports nothing heavy; import the modules you need):

- ``target.TargetModel``: an mlx-lm model as embed / layers / head; ``forward(tokens, cache,
  capture=ids, layer_fn=..., last_only=...) -> (logits, features)``.
- ``drafter``: ``DFlashConfig``, ``DFlashDraftModel`` (``bind(embed, head)``, ``make_cache()``,
  ``add_context(features, cache)``, ``__call__(block, features, cache) -> logits``),
  ``load_drafter``, ``save_drafter``, ``check_drafter_format``.
- ``cache``: ``GDNRollbackCache`` (``rollback(n_keep)`` per int or per batch row),
  ``TargetCache`` (a list of mlx-lm caches; ``begin_verify(T)``, ``rollback(n_keep)``,
  ``commit()``, ``offset``), ``make_target_cache(model)``.
- ``verify``: ``verify_forward(target, tokens, cache, capture=ids)`` (records what rollback
  needs), ``verify_layer`` (the ``layer_fn``), ``gdn_verify``.
- ``sampling``: ``SamplingParams``, ``KeyStream``, ``probs``, ``sample``, ``choose``,
  ``accept_greedy``, ``accept_rejection``.
- ``dflash``: ``dflash_generate`` / ``plain_generate`` (generators of ``PrefillDone``,
  ``RoundDone`` / ``StepDone``, ``Summary``), ``prefill``, ``run``.
- ``pair``: ``load_pair``, ``Pair``, ``validate_pair``, ``encode_prompt``, registry/demo lookup.

The recurrence with per-step states is ``hf2q.kernels.gated_delta.gated_delta_steps``.
"""
