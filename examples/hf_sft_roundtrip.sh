#!/usr/bin/env bash
# Hugging Face model -> ODC SFT on a JSONL file -> Hugging Face model
# Shows: --load-hf (GPT shape, weights and tokenizer from an HF dir), ODC SFT on 2 ranks, --save-hf and python -m megatron_odc.hf export, transformers reloading both
# Needs: cpu
# Takes: about 60 s on 2 CPU cores (EXAMPLE_TINY=1: about 55 s)
set -euo pipefail

# HF_MODEL_DIR: a local Hugging Face model directory (Llama, Qwen2 or Qwen3; nothing is downloaded).
# Unset: a tiny random Llama is made here with transformers. DATA: an SFT JSONL file (one
# {"prompt": ..., "response": ...} or {"messages": [...]} per line); unset: a small one is made here.
# Every output goes under ${EXAMPLE_DIR:-./example_out}/hf_sft_roundtrip.
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
OUT=$(mkdir -p "${EXAMPLE_DIR:-./example_out}/hf_sft_roundtrip" && cd "${EXAMPLE_DIR:-./example_out}/hf_sft_roundtrip" && pwd)
ITERS=$([[ "${EXAMPLE_TINY:-0}" == 1 ]] && echo 4 || echo 20)

if [[ -z "${HF_MODEL_DIR:-}" ]]; then
  HF_MODEL_DIR=$OUT/tiny_llama
  python - "$HF_MODEL_DIR" <<'PY'
import sys

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

out = sys.argv[1]
words = "the model reads a long document and answers questions about it quickly".split()
vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", "<pad>", "<|", "|>", "user", "assistant", *words])}
backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
backend.pre_tokenizer = pre_tokenizers.Whitespace()
transformers.PreTrainedTokenizerFast(
    tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
).save_pretrained(out)
torch.manual_seed(0)
config = transformers.LlamaConfig(
    vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2, pad_token_id=3,
)
transformers.LlamaForCausalLM(config).save_pretrained(out)
print(f"wrote a tiny random Llama to {out}")
PY
fi

DATA=${DATA:-$OUT/sft.jsonl}
if [[ ! -f "$DATA" ]]; then
  python - "$DATA" <<'PY'
import json
import random
import sys

rng = random.Random(0)
words = "the model reads a long document and answers questions about it quickly".split()
with open(sys.argv[1], "w") as f:
    for _ in range(64):
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))
        f.write(json.dumps({"prompt": prompt, "response": " ".join(sorted(prompt.split()))}) + "\n")
print(f"wrote {sys.argv[1]}")
PY
fi

# 1. Fine-tune with ODC on 2 CPU ranks: the GPT's shape, weights and tokenizer come from HF_MODEL_DIR;
#    a megatron checkpoint goes to ckpt/, the fine-tuned HF model to hf_trained/.
python -m torch.distributed.run --standalone --nproc-per-node 2 -m megatron_odc.train \
  --load-hf "$HF_MODEL_DIR" --dp-backend odc \
  --sft --data-path "$DATA" --seq-length 128 --global-batch-size 8 \
  --train-iters "$ITERS" --lr 3e-3 --log-interval 2 \
  --save "$OUT/ckpt" --save-hf "$OUT/hf_trained"

# 2. The same model from the megatron checkpoint (for runs that saved only --save).
python -m megatron_odc.hf export "$OUT/ckpt" "$OUT/hf_exported" --hf-config "$HF_MODEL_DIR"

# 3. Check the round trip: transformers loads both, they agree, and they are not the start's weights.
python - "$HF_MODEL_DIR" "$OUT/hf_trained" "$OUT/hf_exported" <<'PY'
import sys

import torch
import transformers

start, trained, exported = sys.argv[1:]
tokenizer = transformers.AutoTokenizer.from_pretrained(trained)
ids = tokenizer("the model reads a long document", return_tensors="pt").input_ids
logits = {}
for name, path in (("start", start), ("trained", trained), ("exported", exported)):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        logits[name] = model(ids).logits
same = float((logits["trained"] - logits["exported"]).abs().max())
moved = float((logits["trained"] - logits["start"]).abs().max())
assert same < 1e-5, f"--save-hf and the exported checkpoint differ by {same}"
assert moved > 1e-3, "the fine-tuned model still has the start's weights"
print(f"round trip OK: transformers reloads {trained} and {exported}; they differ by {same:.1e}, "
      f"fine-tuning moved the logits by {moved:.3f}")
PY
