"""DSpark, the block drafter with a Markov head: DFlash's network (one non-causal pass over a block read
from the target's aux hidden states) plus a low-rank Markov head that biases each draft's logits by
the token before it, applied left to right, and a confidence head that estimates each draft's
acceptance. ``network`` (the drafter), ``objective`` (its loss and block drafting), ``folder`` (the
layout vLLM's GPU model runner loads), ``check``, and ``kind.KIND`` joining them for the stages."""
