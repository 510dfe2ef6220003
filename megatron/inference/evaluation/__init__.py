"""Zero-shot evaluation of a trained GPT, as Megatron's ``tasks/zeroshot_gpt``.

- ``detokenizer``: WikiText/PTB text back to plain text before tokenizing.
- ``datasets``: the WikiText windows (``--overlapping-eval`` stride) and LAMBADA examples.
- ``model``: ``build_model_for_evaluation``, this rank's model chunks loaded through
  ``megatron.inference.loading`` (our checkpoint saved at any layout, or a Hugging Face
  GPT-2 folder), the loader generation shares.
- ``zeroshot``: the forward-only loop over any tensor/pipeline/data-parallel layout, the
  reductions over the right groups, and Megatron's result lines.

Entry points: ``tasks/main.py --task WIKITEXT103|LAMBADA`` (Megatron's command) and
``tools/evaluate.py``.
"""
