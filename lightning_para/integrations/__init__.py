"""Optional glue for third-party model libraries (each imports its library lazily, only where needed).

* :mod:`lightning_para.integrations.transformers`: Hugging Face ``transformers`` causal LMs under
  every layout (``pip install lightning-para[transformers]``).
* :mod:`lightning_para.integrations.litgpt`: LitGPT models (``litgpt.model.GPT``) under every layout, LitGPT
  checkpoint folders in and out (``pip install lightning-para[litgpt]``).
"""
