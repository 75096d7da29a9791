"""``d9d plan``: its flags (``_parser``), its run (``_command``) and the plan, memory and
collectives of a layout on simulated ranks (``_show``)."""
