"""The engine (``d9d.core``): models as pure functions, per-param plans, the transformed step,
the running step's context, the collectives it issues, differentiation and ``jit``.

Its public names are re-exported where users meet them: ``d9d`` (``functionalize``, ``jit``,
``value_and_grad``, ``make_mesh``, ...) and ``d9d.transforms`` (the transform protocol:
``Transform``, ``ParamPlan``, ``Runtime``, ...). This package imports none of its modules, so
``import d9d.core._mesh`` (a base module) costs only that module. ``docs/architecture.md``
lists what each module holds.
"""

__all__: list[str] = []
