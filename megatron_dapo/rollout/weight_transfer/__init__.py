"""How the actor's weights reach the engines: the ``WeightTransport`` seam (``transport.py``), one module and one class
per transport (``direct_transport.py``, ``reload_transport.py``, ``lora_transport.py``) and the factory that builds a
run's sync from its ``RunPlan`` (``factory.py``). ``rollout/sync.WeightSync`` plans and gathers the buckets they
deliver. Imports nothing, so importing one module loads only what it needs."""
