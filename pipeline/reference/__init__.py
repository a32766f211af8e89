"""Reference models and data for the scripts, tests and examples.

``pipeline.reference.models`` (``gpt``, ``resnet``, ``mlp`` as ``nn.Sequential``
chains) and ``pipeline.reference.data`` (character-level text, batches drawn by
step). Users may import them to try the pipeline on something real; they are
not part of the runtime, and ``pipeline`` itself does not import this package.
"""

__all__: list[str] = []
