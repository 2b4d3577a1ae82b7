"""um_alloc without changes to the training loop: the launcher (``python -m um_alloc run``) and
callbacks for Hugging Face's Trainer and Lightning.

- launcher.py, auto.py, model_finder.py: a script run unchanged; PyTorch's global hooks find the
  model and the optimizers.
- huggingface.py, lightning.py: ``UMAllocCallback`` for each; import them from their modules
  (``um_alloc.integrations.huggingface``), which import their framework.
- attach.py: what all of them share (the policy, installing before CUDA, the planner, the report).
"""
