"""Two gloo ranks through ``MegatronParallel`` with uneven data, launched by ``test_lightning_engine.py``.

    torchrun --nproc_per_node=2 engine_job.py --case empty|text-only --out result.json

``empty``: the toy regressor; rank 1's batch is empty (every utterance skipped). ``text-only``: a tiny SALM; rank 1's
batch has no audio, so the perception parameters get no gradient there. Each rank runs one training step through
Megatron's DDP and ``finalize_model_grads``; rank 0 compares the reduced gradients with one process computing the
loss of both batches together, and writes the largest difference.
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "speechlm"))


def toy_batches():
    from speechtrain.testing.toy_models import ToyTransformerRegressor, toy_dataset

    def build():
        model = ToyTransformerRegressor({"batch_size": 4})
        model.configure_model()
        return model

    frames, targets, lengths = toy_dataset(build().cfg).tensors
    return build, [(frames[:4], targets[:4], lengths[:4]), None]


def salm_batches():
    from test_speechlm_model import TEXTS, tiny_salm_config

    from speechtrain.corpora.dtmf import make_dtmf_corpus
    from speechtrain.speechlm.model import SALMModel
    from speechtrain.speechlm.prompts import get_template
    from speechtrain.speechlm.tokenizer import train_bpe_tokenizer

    folder = Path(tempfile.mkdtemp())
    train_bpe_tokenizer(TEXTS, 300, get_template("llama3").special_tokens).save(folder)
    manifest = make_dtmf_corpus(folder / "dtmf", 16, seed=7)

    def build():
        model = SALMModel(tiny_salm_config(folder / "tokenizer.json", manifest))
        model.configure_model()
        return model

    model = build()
    model.setup_data("fit")
    batch = next(iter(model._val_loaders[0]))
    assert len(batch["ids"]) == 8, len(batch["ids"])
    audio = {k: (v[:4] if isinstance(v, torch.Tensor | list) else v) for k, v in batch.items()}
    text = {k: (v[4:8] if isinstance(v, torch.Tensor | list) else v) for k, v in batch.items()}
    # The same conversations with the audio taken out: the placeholder becomes an ordinary text token.
    word = text["input_ids"][text["loss_mask"]][0]  # a token of an answer
    text["input_ids"] = torch.where(text["input_ids"] == model.audio_id, word, text["input_ids"])
    text["audio"], text["audio_lens"] = text["audio"][:0], text["audio_lens"][:0]
    return build, [audio, text]


def _to(batch, device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple | list):
        return type(batch)(_to(v, device) for v in batch)
    return batch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=["empty", "text-only"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cpu", help="cuda: NCCL, one GPU per rank")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.distributed.init_process_group("nccl" if cuda else "gloo")
    rank = torch.distributed.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    from megatron.core import parallel_state as mpu

    from speechtrain.lightning import MegatronParallel
    from speechtrain.lightning.megatron_compat import import_megatron, model_parallel_manual_seed, use_device

    import_megatron()
    use_device(device)
    mpu.initialize_model_parallel(1, 1)
    model_parallel_manual_seed(0)
    build, batches = toy_batches() if args.case == "empty" else salm_batches()
    shared = [batches]
    torch.distributed.broadcast_object_list(shared, src=0)  # rank 0's batches everywhere
    batches = shared[0]
    model, reference = build(), build()
    reference.load_state_dict(model.state_dict())
    model.to(device), reference.to(device)
    batches = [_to(b, device) for b in batches]
    model.eval(), reference.eval()  # no dropout draws: the two runs see the same function

    engine = MegatronParallel(model, device=device)
    engine.start_window()
    loss = engine.run(batches[rank], forward_only=False)

    # One process, both batches: sum of the losses over all tokens, plain autograd.
    sums = [reference.loss_step(b, reference.forward_step(b)) for b in batches if b is not None]
    total = sum(s for s, _ in sums) / sum(n for _, n in sums)
    total.backward()
    differences = {
        name: float((param.main_grad - (ref.grad if ref.grad is not None else torch.zeros_like(ref))).abs().max())
        for (name, param), ref in zip(model.named_parameters(), reference.parameters())
        if param.requires_grad
    }
    unused = [n for n, p in model.named_parameters() if p.requires_grad and p.main_grad.abs().max() == 0]
    if rank == 0:
        Path(args.out).write_text(json.dumps({
            "loss": float(loss), "reference_loss": float(total.detach()), "max_difference": max(differences.values()),
            "worst": max(differences, key=differences.get), "parameters": len(differences), "zero": unused,
        }))  # fmt: skip


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    main()
