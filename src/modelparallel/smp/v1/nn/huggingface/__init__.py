"""SMP v1's Hugging Face state-dict translators (``smp.nn.huggingface``).

``gpt2``: ``translate_hf_state_dict_to_smdistributed_gpt2`` and
``translate_state_dict_to_hf_gpt2`` (and the per-layer variants). SMP's translators for
BERT, RoBERTa, GPT-J, GPT-Neo, GPT-NeoX, T5 and ViT are not provided: those families are
split in place by ``smp.DistributedModel`` / ``tsm.transform`` with their Hugging Face
modules and names kept, so their state dicts need no translation.
"""

from modelparallel.smp.v1.nn.huggingface import gpt2  # noqa: F401  (an attribute, as in SMP)
