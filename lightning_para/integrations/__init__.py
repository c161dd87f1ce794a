"""Optional glue for third-party model libraries (each imports its library lazily, only where needed).

* :mod:`lightning_para.integrations.transformers`: Hugging Face ``transformers`` causal LMs under
  every layout (``pip install lightning-para[transformers]``).
"""
