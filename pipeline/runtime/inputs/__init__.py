"""A step's data and a model's weights as they come in: ``microbatch`` (a batch split into
micro-batches, their signatures), ``varlen`` (sequences of every length packed under a token
budget) and ``pretrained`` (safetensors weights read per stage). May import ``comm``.
"""
