"""Integrations of attn_ext with other libraries, each imported only on request.

    attn_ext.integrations.transformers   Hugging Face transformers' attention interface
"""
