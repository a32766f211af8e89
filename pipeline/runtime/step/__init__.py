"""One rank's step: ``steps`` (a call's work: the batch in, the program run, the tail's collectives
and the loss). A call's data takes one straight path, a module each, each handing the next a value:

    prepare.py   inputs, targets -> Prepared     split into micro-batches, or packed by length
    describe.py  Prepared -> Described           the header every rank reads, stages' signatures
    place.py     Prepared -> Placed              on the device (copy stream, or a prefetched copy)
    executor.py  Described, Placed -> the step   runs the program and nothing else

Beside them: ``program`` (the rank's program bound to its stages and messages), ``metadata`` (the
header's and signatures' protocol), ``stage`` (a stage's F, B and W), ``recompute``, ``compiled``
(``compile=``: each layer through torch.compile), ``clock`` (busy time), ``memory`` and ``live``
(bytes held and measured), ``grads`` (norms, clipping, finiteness), ``outputs`` (the model's
outputs to the ranks that ask) and ``drain`` (a device-wide sync forced mid-step). May import every
room below it.
"""
