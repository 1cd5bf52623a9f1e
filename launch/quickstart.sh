#!/usr/bin/env bash
# The embedded default run on a fresh machine: set up .venv, make the tiny task + tokenizer + model (seeded),
# convert it with the converter CLI, train DAPO with vLLM rollout on 2 CPU processes, export the trained model to HF,
# plot the curves. Extra arguments are config overrides, e.g. trainer.total_training_steps=10.
# QUICKSTART_DIR (default outputs/quickstart) is where everything goes; its run/ is replaced on every call.
# Last line: first_val_acc=<x> final_val_acc=<y> steps=<n> wall_s=<t>
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/setup_env.sh
export OMP_NUM_THREADS=1
OUT="${QUICKSTART_DIR:-outputs/quickstart}"
START=$(date +%s)

if [ ! -f "$OUT/hf_model/config.json" ]; then
  echo "[quickstart] making the tiny task, tokenizer and model under $OUT"
  python -m megatron_dapo.tasks.demo --out-dir "$OUT"
fi
if [ ! -f "$OUT/mcore/latest_checkpointed_iteration.txt" ]; then
  echo "[quickstart] converting the HF model to Megatron layout"
  python tools/checkpoint_convert/convert.py hf-to-mcore --hf-dir "$OUT/hf_model" --save-dir "$OUT/mcore"
fi

echo "[quickstart] DAPO training on 2 CPU processes (configs/tiny_cpu.yaml)"
rm -rf "$OUT/run"
NPROC_PER_NODE=2 MASTER_PORT="${MASTER_PORT:-29510}" launch/run_local.sh configs/tiny_cpu.yaml \
  model.hf_config_dir="$OUT/hf_model" model.tokenizer_dir="$OUT/tokenizer" checkpoint.load_dir="$OUT/mcore" \
  data.train_files="[$OUT/data/train.parquet]" data.val_files="[$OUT/data/val.parquet]" \
  trainer.output_dir="$OUT/run" "$@"

echo "[quickstart] exporting the last checkpoint to HF and plotting"
EXPORT_ARGS=()
# A LoRA run (actor.lora.rank=N) saves adapters only: export the base with the adapters merged in.
for arg in "$@"; do [[ "$arg" =~ ^actor\.lora\.rank=[1-9] ]] && EXPORT_ARGS=(--lora merged); done
python -m megatron_dapo.cli export --checkpoint "$OUT/run/checkpoints" --save-dir "$OUT/run/hf_export" "${EXPORT_ARGS[@]}"
python tools/plot_metrics.py "$OUT/run/metrics.jsonl" -o "$OUT/run/curves.png"

python - "$OUT/run/metrics.jsonl" "$START" <<'PY'
import json, sys, time
rows = [json.loads(line) for line in open(sys.argv[1])]
accs = [(r["step"], v) for r in rows for k, v in r.items() if k.startswith("val-core/") and "/acc/" in k]
steps = max(r["step"] for r in rows)
print(f"first_val_acc={accs[0][1]:.4f} final_val_acc={accs[-1][1]:.4f} steps={steps} wall_s={time.time() - float(sys.argv[2]):.0f}")
PY
