"""The partitioned weights under ZeRO-3, below the engines that own them: gathering (``zero3``), reading them as HF
tensors (``hf_weights``), LoRA adapters (``lora``) and the generation replica (``replica``)."""
