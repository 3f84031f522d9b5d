"""GPT-3-sized decoders (Brown et al., 2020), built from the GPT-2 modules.

"Language Models are Few-Shot Learners" (NeurIPS 2020), Table 2.1:

==========  ========  =======  =======  ======  =========
name        n_params  n_layer  d_model  n_head  d_head
==========  ========  =======  =======  ======  =========
GPT-3 XL    1.3B      24       2048     24*     128
GPT-3 2.7B  2.7B      32       2560     32      80
GPT-3 6.7B  6.7B      32       4096     32      128
GPT-3 13B   13.0B     40       5140     40      128
==========  ========  =======  =======  ======  =========

(*) Table 2.1 prints 24 heads for XL; 2048 / 128 = 16, which is what is
built here (the head count does not change the parameter count).

The paper uses "the same model and architecture as GPT-2" with a context of
2048 tokens, so each size here is :class:`hetspmd.models.gpt2.GPT2` with
``n_ctx=2048``: vocabulary 50257, learned position embeddings, pre-LayerNorm
blocks with a 4x MLP, output projection tied to the token embedding. GPT-3
alternates dense and locally banded sparse attention layers; every layer here
is dense (the banded layers have the same weights, so the parameter count is
the same; the attention FLOPs are an upper bound).

Parameter counts. Table 2.1 rounds ``n_params`` to two significant figures,
and the architectures it lists (13B at width 5120, see below) hold
1,315,723,264 / 2,651,553,280 / 6,658,404,352 / 12,853,386,240 parameters,
+1.2%, -1.8%, -0.6% and -1.1% off 1.3B / 2.7B / 6.7B / 13.0B: too coarse for
the zoo's 1% check. Table D.1
(compute used to train each model) lists them to more digits, as 1,320M,
2,650M, 6,660M and 12,850M; ``published_params`` takes those, and every
count here is within 0.4% of them.

The 13B width. Table 2.1 prints ``d_model = 5140``, which is not
``n_head * d_head = 40 * 128 = 5120``. Built at 5140 (attention inner width
5120) the model has 12,936,488,380 parameters, 0.7% above Table D.1's
12,850M; at 5120 it has 12,853,386,240, 0.03% off. So 5140 reads as a typo
for 5120, and 5120 is used; with it every size has ``d_model = n_head *
d_head`` and the GPT-2 modules need no separate head width.

Abstract construction uses the zoo's linear-time build
(:func:`hetspmd.models.workload.abstract_rngs`): 13B in under a second.
"""

from __future__ import annotations

import optax

from hetspmd.models.gpt2 import GPT2, GPT2Config, lm_batch_spec, lm_loss
from hetspmd.models.workload import Workload

_SOURCE = "GPT-3 (Brown et al., 2020), Table 2.1 sizes, Table D.1 parameter counts"


def _config(n_layer: int, d_model: int, n_head: int) -> GPT2Config:
  return GPT2Config(n_layer=n_layer, n_head=n_head, d_model=d_model, n_ctx=2048)


CONFIGS = {
    # name: (config, Table D.1 parameter count)
    "gpt3-1.3b": (_config(24, 2048, 16), 1_320_000_000),
    "gpt3-2.7b": (_config(32, 2560, 32), 2_650_000_000),
    "gpt3-6.7b": (_config(32, 4096, 32), 6_660_000_000),
    "gpt3-13b": (_config(40, 5120, 40), 12_850_000_000),
}


def workloads() -> list[Workload]:
  return [
      Workload(
          name=name,
          family="gpt3",
          config=cfg,
          build=GPT2,
          loss=lm_loss,
          batch_spec=lm_batch_spec,
          make_optimizer=lambda: optax.adam(3e-4),
          default_batch=8,
          default_seq=2048,
          max_seq=cfg.n_ctx,
          published_params=published,
          source=_SOURCE,
      )
      for name, (cfg, published) in CONFIGS.items()
  ]
