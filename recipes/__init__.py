"""recipes: production-grade PyTorch data-loading recipes.

Domains: `recipes.common`, `recipes.vision`, `recipes.nlp`, `recipes.audio`.
"""

__version__ = "0.1.0"
