"""Runtime: target and drafter models, caches with rollback, the DFlash decoding loop, sampling."""
