"""``expert_parallel``: experts sharded over a mesh axis; tokens dispatched to them and combined back."""
