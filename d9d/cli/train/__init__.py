"""``d9d train``: its flags (``_parser``), its run (``_command``) and the training loop
behind it (``_run``) with its checkpoints, data, evaluation, logs and reports."""
