#!/usr/bin/env bash
# Agentic RL on a fresh machine (docs/agent.md): set up .venv, make the tiny tool task, tokenizer and model
# (megatron_dapo/tasks/agent.py, seeded), convert it, train DAPO with multi-turn tool-calling rollout on 2 CPU
# processes (configs/tiny_agent_cpu.yaml), then score the final checkpoint with `megatron-dapo eval` (same tools).
# Extra arguments are config overrides. AGENT_DIR (default outputs/agent) is where everything goes; its run/ is
# replaced on every call; run/rollouts/ holds every step's samples with their token ids and loss masks.
# Last line: first_val_acc=<x> final_val_acc=<y> tool_called_frac=<z> eval_acc=<e> steps=<n> wall_s=<t>
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/setup_env.sh
export OMP_NUM_THREADS=1
OUT="${AGENT_DIR:-outputs/agent}"
START=$(date +%s)

if [ ! -f "$OUT/hf_model/config.json" ]; then
  echo "[agent] making the tool task, tokenizer and model under $OUT"
  python -m megatron_dapo.tasks.agent --out-dir "$OUT" > /dev/null
fi
if [ ! -f "$OUT/mcore/latest_checkpointed_iteration.txt" ]; then
  echo "[agent] converting the HF model to Megatron layout"
  python tools/checkpoint_convert/convert.py hf-to-mcore --hf-dir "$OUT/hf_model" --save-dir "$OUT/mcore"
fi

echo "[agent] DAPO with multi-turn tool calls on 2 CPU processes (configs/tiny_agent_cpu.yaml)"
rm -rf "$OUT/run"
NPROC_PER_NODE=2 MASTER_PORT="${MASTER_PORT:-29520}" launch/run_local.sh configs/tiny_agent_cpu.yaml \
  model.hf_config_dir="$OUT/hf_model" model.tokenizer_dir="$OUT/tokenizer" checkpoint.load_dir="$OUT/mcore" \
  data.train_files="[$OUT/data/train.parquet]" data.val_files="[$OUT/data/val.parquet]" \
  rollout.multi_turn.tool_config_path="$OUT/tools.yaml" trainer.output_dir="$OUT/run" \
  trainer.rollout_data_dir="$OUT/run/rollouts" "$@"

echo "[agent] megatron-dapo eval on the final checkpoint (greedy, with the tools)"
if ! python -m megatron_dapo.cli eval --model "$OUT/run/checkpoints" --data "$OUT/data/val.parquet" \
  --output-dir "$OUT/run/eval" > "$OUT/run/eval.log" 2>&1; then
  tail -n 40 "$OUT/run/eval.log"
  exit 1
fi

python - "$OUT/run" "$START" <<'PY'
import json, sys, time
from pathlib import Path
run = Path(sys.argv[1])
rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
val = [r for r in rows if "val-core/lookup/acc/mean@1" in r]
summary = json.loads((run / "eval" / "summary.json").read_text())
print(
    f"first_val_acc={val[0]['val-core/lookup/acc/mean@1']:.4f} final_val_acc={val[-1]['val-core/lookup/acc/mean@1']:.4f}"
    f" tool_called_frac={val[-1]['val-aux/tool/called_frac']:.4f} eval_acc={summary['lookup']['mean@1']:.4f}"
    f" steps={max(r['step'] for r in rows)} wall_s={time.time() - float(sys.argv[2]):.0f}"
)
PY
