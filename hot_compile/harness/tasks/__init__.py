"""Training tasks that compare ``backend="hot"`` with ``backend="inductor"`` fp32 on real data.

* ``gpt``: a byte-level GPT-style language model on CPython's documentation text (held-out loss);
* ``vit``: a small Vision Transformer trained from scratch on scikit-learn's digits (test accuracy);
* ``minilm``: the pretrained all-MiniLM-L6-v2 fine-tuned to tell documentation topics apart (test accuracy);
* ``cnn``: a small residual CNN trained from scratch on the same digits (test accuracy).

``python -m hot_compile.harness.tasks TASK`` runs one (``ablation``: task 1 with each part of HOT alone);
``hot-compile demo`` is task 1 with a progress bar, a report and a plot. Both variants of a run start
from one set of weights and see one data order (``common.train_side_by_side``).
"""
