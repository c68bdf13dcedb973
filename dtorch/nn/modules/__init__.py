"""dtorch.nn modules: one concept per file (module, linear, embedding, norm, activation,
container)."""

from .activation import GELU, Dropout, Identity, ReLU, SiLU
from .container import ModuleDict, ModuleList, Sequential
from .embedding import Embedding, EmbeddingWithReplicateOutput, VocabParallelEmbedding
from .linear import (ColumnParallelLinear, ColumnParallelLinearWithReplicateInputOutput,
                     ColumnParallelLinearWithReplicateOutput, Linear, ReplicateParallelLinear,
                     RowParallelLinear, RowParallelLinearWithReplicateOutput)
from .module import Module, ModuleError
from .norm import LayerNorm, RMSNorm

__all__ = ["Module", "ModuleError", "Linear", "ColumnParallelLinear",
           "ColumnParallelLinearWithReplicateOutput",
           "ColumnParallelLinearWithReplicateInputOutput", "RowParallelLinear",
           "RowParallelLinearWithReplicateOutput", "ReplicateParallelLinear", "Embedding",
           "EmbeddingWithReplicateOutput", "VocabParallelEmbedding", "ModuleList", "ModuleDict",
           "Sequential", "RMSNorm", "LayerNorm", "SiLU", "GELU", "ReLU", "Dropout", "Identity"]
