"""One rank's step: ``steps`` (a call's work: the batch in, the program run, the tail's collectives
and the loss), ``program`` (the rank's program bound to its stages and messages), ``executor`` (runs
it), ``metadata`` (the step header and inter-stage signatures), ``stage`` (a stage's F, B and W),
``recompute``, ``clock`` (busy time), ``memory`` and ``live`` (bytes held and measured), ``grads``
(norms, clipping, finiteness), ``outputs`` (the model's outputs to the ranks that ask) and
``drain`` (a device-wide sync forced mid-step). May import every room below it.
"""
