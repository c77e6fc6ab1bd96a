#!/usr/bin/env bash
# GPU check of the llm_sft recipe (not a test; needs one NVIDIA GPU, e.g. an H200, and the project's venv):
#   1. prepares a synthetic corpus (byte-level BPE trained in-process, packed 2,048-token sequences),
#   2. trains llm_sft from scratch on a ~650M-parameter Llama-style config (bf16 autocast, sdpa,
#      torch.compile) on one GPU and prints tokens/s and MFU (target: MFU >= 45%); then the same under
#      train.parallelism=fsdp in bf16 (one rank: the loop's throughput and MFU with the FSDP wrapper, its
#      mixed-precision policy and per-layer units; no communication, not compiled) beside it,
#   3. runs the image and tabular demos once with nccl,
#   4. with the unsloth toolchain built (make toolchain NAME=unsloth), one rank of Unsloth LoRA fine-tuning on a
#      ~50M-parameter Llama-style checkpoint with its GPU kernels, and prints its tokens/s.
#
#   bench/gpu_check.sh             # ROWS=600 rows per corpus file (16 files: ~400 steps of 8 x 2,048 tokens);
#                                  # PREPARE_ONLY=1 stops after the preparation (a check without a GPU)
#
# Everything goes to a fresh PIPELINE_HOME (printed); nothing is fetched from a hub.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
ROWS=${ROWS:-600}
export PIPELINE_HOME=${PIPELINE_HOME:-$(mktemp -d /tmp/gpu-check-XXXX)/home}
OUT=$PIPELINE_HOME/gpu_check
mkdir -p "$OUT"
echo "PIPELINE_HOME=$PIPELINE_HOME"
[ -n "${PREPARE_ONLY:-}" ] || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

# 1. Corpus: 16 JSON Lines files (one preparation unit each, converted in parallel) of prompt/response rows
# of pseudo-words, and a tokenizer trained on them.
$PY - "$OUT" "$ROWS" <<'PYEOF'
import json, random, sys
from pathlib import Path
from pipeline.recipes.llm_sft.demo import train_tokenizer

out = Path(sys.argv[1]) / "corpus"
out.mkdir(parents=True, exist_ok=True)
rng = random.Random(0)
words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(20000)]
def text(n):
    return " ".join(rng.choice(words) for _ in range(n))
sample = []
for part in range(16):
    rows = [{"prompt": text(rng.randint(50, 150)), "response": text(rng.randint(200, 500))} for _ in range(int(sys.argv[2]))]
    sample += [r["prompt"] + " " + r["response"] for r in rows[:200]]
    (out / f"part-{part:02d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
train_tokenizer(sample, out.parent / "tokenizer", vocab_size=32000)
print(f"corpus: 16 x {sys.argv[2]} rows in {out}")
PYEOF

URI=$($PY - "$OUT" <<'PYEOF'
import sys, time
from pathlib import Path
from pipeline.data.prepare import prepare
from pipeline.recipes import get_recipe

out = Path(sys.argv[1])
cfg = get_recipe("llm_sft").config().with_overrides({
    "data.input_path": str(out / "corpus"), "data.key_column": "", "data.format": "jsonl", "data.tokenizer_path": str(out / "tokenizer"),
    "data.max_seq_len": 2048, "data.packing": True, "data.workers": 16, "data.val_fraction": 0.01,
    "data.test_fraction": 0.01})
started = time.perf_counter()
manifest = prepare(cfg.data, name="llm_gpu_check", out_root=out / "datasets")
print(f"prepared {manifest['splits']} in {time.perf_counter() - started:.1f}s; {manifest['transform']}", file=sys.stderr)
print(manifest["uri"])
PYEOF
)

[ -z "${PREPARE_ONLY:-}" ] || exit 0

# 2. ~650M parameters: 24 layers, hidden 1536, 12 heads of 128 (4 key/value heads), SwiGLU 4096, vocab ~32k, from
# scratch (no pretrained checkpoint, no LoRA); with ddp (compiled) and with fsdp (bf16 parameters, fp32 reduction).
train_llm() {  # NAME, then extra --set arguments
  local name=$1; shift
  rm -rf "$OUT/$name"
  $PY -m torch.distributed.run --standalone --nproc-per-node=1 -m pipeline.rank --recipe llm_sft --dataset "$URI" \
    --out "$OUT/$name" --set model.pretrained_path= --set model.lora=false --set 'model.lora_layers=[]' \
    --set model.hidden_size=1536 --set model.num_layers=24 --set model.num_heads=12 --set model.num_kv_heads=4 \
    --set model.intermediate_size=4096 --set model.eval_max_examples=32 \
    --set train.precision=bf16 --set train.batch_size=8 --set train.epochs=1 --set train.learning_rate=3e-4 \
    --set train.log_every_steps=20 --set train.checkpoint_every_steps=0 --set launch.backend=nccl \
    --set train.warmup_steps=20 "$@" 2>&1 | tee "$OUT/$name.log" | grep -E "training on|step [0-9]+/|saved model" || true
  $PY - "$OUT/$name/result.json" "$name" <<'PYEOF'
import json, sys
r = json.load(open(sys.argv[1]))
t = r["throughput"]
print(f"llm_sft {sys.argv[2]} ({r['parallelism']}): {r['steps']} steps, {t.get('tokens_per_s', 0):,.0f} tokens/s, "
      f"MFU {t.get('mfu', float('nan')):.1%} (target >= 45% for ddp), {r['precision']}, train wall {r['train_wall_s']}s")
PYEOF
}
train_llm train --set model.compile=true
train_llm train-fsdp --set train.parallelism=fsdp
$PY - "$OUT/train/result.json" "$OUT/train-fsdp/result.json" <<'PYEOF'
import json, sys
ddp, fsdp = (json.load(open(path))["throughput"] for path in sys.argv[1:3])
print(f"fsdp/ddp tokens/s on one GPU: {fsdp['tokens_per_s'] / ddp['tokens_per_s']:.2f} (ddp compiled, fsdp not)")
PYEOF

# 3. The image and tabular demos once on this GPU with nccl (one rank).
for recipe in image_classifier tabular_mlp; do
  $PY -m pipeline.dev.demo --recipe "$recipe" --conf '{"nproc_per_node": 1, "overrides": {"launch.backend": "nccl"}}' \
    2>&1 | tail -1
done

# 4. Unsloth on this GPU: LoRA on a small Llama-style checkpoint (hidden 512, 8 layers), 30 steps of 8 x 512 tokens.
UNSLOTH=$($PY -m pipeline.toolchains list unsloth | $PY -c 'import json, sys; r = json.load(sys.stdin); print(r["env"] if r["built"] else "")')
if [ -z "$UNSLOTH" ]; then
  echo "unsloth: not built (make toolchain NAME=unsloth); skipped"
  exit 0
fi
$PY - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path
from pipeline.recipes.llm_sft.demo import write_tiny_checkpoint

out = Path(sys.argv[1])
write_tiny_checkpoint(out / "tokenizer", out / "unsloth-base", hidden_size=512, num_layers=8)
lines = (out / "corpus" / "part-00.jsonl").read_text().splitlines()
(out / "unsloth-train.jsonl").write_text("".join(
    json.dumps({"prompt": r["prompt"], "completion": r["response"]}) + "\n" for r in map(json.loads, lines)))
(out / "unsloth.yaml").write_text(
    "max_seq_length: 512\nlora: {r: 16, lora_alpha: 16, target_modules: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]}\n"
    "sft: {max_steps: 30, per_device_train_batch_size: 8, learning_rate: 0.0002, max_length: 512, logging_steps: 10, "
    "save_strategy: 'no', bf16: true}\n")
PYEOF
rm -rf "$OUT/unsloth-job"
PIPELINE_JOB_DIR=$OUT/unsloth-job PIPELINE_CHECKPOINT_DIR=$OUT/unsloth-job/checkpoints HF_HUB_OFFLINE=1 PYTHONPATH=$PWD \
  "$UNSLOTH/bin/python" -m torch.distributed.run --standalone --nproc-per-node=1 toolchains/unsloth/sft.py \
  --model "$OUT/unsloth-base" --data "$OUT/unsloth-train.jsonl" --config "$OUT/unsloth.yaml" 2>&1 \
  | tee "$OUT/unsloth.log" | tail -1 > "$OUT/unsloth-result.json"
$PY - "$OUT/unsloth-result.json" <<'PYEOF'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"unsloth {r['unsloth_version']}: {r['steps']} LoRA steps on one GPU, {r['tokens_per_s']:,.0f} tokens/s")
PYEOF
