"""LoRA adapters on the ranks: PEFT files read and checked (adapter), per-layer slots and the grouped
product (slots), and their attachment to a model (model_lora)."""
