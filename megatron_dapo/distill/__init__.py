"""On-policy distillation (``docs/distillation.md``): the student samples, a teacher scores the samples, and the
teacher's per-token log-probs give a dense signal. verl 0.9.1's losses as pure functions:

* ``losses.py``: the per-token losses by name (``DISTILLATION_LOSSES``: k1/kl, abs, mse/k2, low_var_kl/k3,
  forward_kl_topk);
* ``objective.py``: a micro-batch's loss — aggregated directly or as the advantage of a policy loss — its metrics,
  and how it joins the task loss;
* ``config_checks.py``: the ``distillation`` section's rules and the teachers by routing key;
* ``tokenizer_match.py``: the refusal of a teacher whose tokenizer is not the student's.
"""
