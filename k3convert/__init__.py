"""k3convert: offline quantize / reshard / verify for frontier-scale MoE checkpoints.

The package never holds a whole model: every stage streams tensor by tensor or layer
by layer, so the same code serves a 300 k-parameter test model and a 3 T release.
"""

__version__ = "0.1.0"
