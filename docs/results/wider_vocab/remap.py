"""The exploratory remaps of this section (before `jetflow draft-vocab` existed): the fifth drafter's
weights and tree calibration unchanged, the draft vocabulary grown from the answer-token counts of all
of smollm2-mix and smollm2-mix2 (held-out split included), or removed (full vocabulary).
Run from the repository root: python docs/results/wider_vocab/remap.py"""
import dataclasses
import glob

import numpy as np
import torch

from jetflow.models.checkpoint import load_drafter
from jetflow.models.draft_head import DraftHead
from jetflow.models.draft_vocab import select_draft_vocab

h = load_drafter('jetflow/drafters/smollm2-135m-instruct', dtype=torch.float32)
counts = np.zeros(49152, dtype=np.int64)
for f in sorted(glob.glob('data/regenerated/smollm2-mix*/shard-*.npz')):
    d = np.load(f)
    t, o, p = d['tokens'].astype(np.int64), d['offsets'], d['prompt_lens']
    for i in range(len(p)):
        np.add.at(counts, t[o[i] + p[i]:o[i + 1]], 1)
sd = {k: v for k, v in h.state_dict().items() if k not in ('d2t', 't2d')}
for size in (16384, 32768):
    c = dataclasses.replace(h.config, draft_vocab_size=size)
    h2 = DraftHead(c)
    h2.load_state_dict(sd, strict=False)
    h2.set_draft_vocab(select_draft_vocab(counts, size, h.draft_ids.tolist()))
    h2.save_pretrained(f'runs/ds/v5-v{size // 1024}k', dtype=torch.bfloat16)
for name, cal in (('v5-full', h.config.tree_calibration), ('v5-full-nocal', None)):
    h3 = DraftHead(dataclasses.replace(h.config, draft_vocab_size=None, tree_calibration=cal))
    h3.load_state_dict(sd, strict=False)
    h3.save_pretrained(f'runs/ds/{name}', dtype=torch.bfloat16)
