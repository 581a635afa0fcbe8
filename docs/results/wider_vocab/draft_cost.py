import torch
from jetflow.decoding.block_drafter import BlockDrafter
from jetflow.decoding.costs import median_ms
from jetflow.models.checkpoint import load_drafter
from jetflow.models.target import TargetModel
torch.set_num_threads(2)  # both cores
target = TargetModel.load(None)
torch.manual_seed(0)
ids = torch.randint(0, target.vocab_size, (256,)).tolist()
for path in ['jetflow/drafters/smollm2-135m-instruct','runs/ds/v5-v16k','runs/ds/v5-v32k','runs/ds/v5-full']:
    head = load_drafter(path, target=target, dtype=torch.float32)
    target.set_tapped_layers(head.config.target_layer_ids)
    d = BlockDrafter(head, target); pre = target.prefill(ids); d.reset(); d.extend(pre.hidden)
    for b in (16, 64):
        ms = median_ms(lambda: d.propose(ids[-1], target.past_len, 7, 7).tree(b), 21)
        print(path, b, round(ms,2))
c1 = median_ms(lambda: target.verify([ids[-1]], [-1], return_hidden=False), 11); print('c1', c1)
