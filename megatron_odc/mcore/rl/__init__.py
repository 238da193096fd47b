"""ODC under a training loop someone else drives (RL and post-training stacks on megatron-core).

- ``loop``: the backend built as DDP / the distributed optimizer would be, the loss contracts that
  stay exact when ranks run different numbers of microbatches (and one-line refusals of the others),
  and the schedule call that accepts a rank-local count, 0 included;
- ``weight_sync``: full (unsharded, TP-gathered on request) weights unit by unit, in megatron or
  Hugging Face names, to stream to a rollout engine;
- ``offload``: the shards, optimizer state and unsharded buffers off the device between phases and
  back, bit for bit;
- ``reference``: a frozen reference model: forward-only fetches, no gradients, pushes or optimizer.

docs/rl.md is the guide. Imports ``megatron.core`` (the mcore layer); nothing is imported with the
package itself.
"""
