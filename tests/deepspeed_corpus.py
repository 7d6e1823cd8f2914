"""Real-world DeepSpeed configs, as their authors wrote them, each with its source.

Each entry: the config; the keys zeroedu's one error must name (empty: it trains as written; "auto" inside a
section DeepSpeed parses with pydantic, such as fp16 or zero_optimization, is DeepSpeed's default there, so only
the Trainer's other "auto" keys are named); and, where the
config needs a change to run here, the change a learner would make (`fix`), after which it must train. Configs
with "auto" are Hugging Face Trainer configs: `trainer_fill` writes the values the Trainer would put in.
"""

from __future__ import annotations

import copy

DSE = "https://github.com/microsoft/DeepSpeedExamples/blob/master/"
HF = "https://github.com/huggingface/transformers/blob/main/tests/deepspeed/"

CORPUS = {
    "cifar": {
        "source": "https://github.com/microsoft/DeepSpeed/blob/cadae08cbde22df331f9dff48be829958b8204f0/"
                  "DeepSpeedExamples/cifar/ds_config.json (the CIFAR-10 tutorial's config)",
        "config": {"train_batch_size": 4, "steps_per_print": 2000,
                   "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                            "weight_decay": 3e-7}},
                   "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                                "warmup_num_steps": 1000}},
                   "wall_clock_breakdown": False},
        "refused": [],
    },
    "hf-zero2": {
        "source": HF + "ds_config_zero2.json",
        "config": {"fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                            "hysteresis": 2, "min_loss_scale": 1},
                   "bf16": {"enabled": "auto"},
                   "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                             "weight_decay": "auto"}},
                   "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                                "warmup_num_steps": "auto"}},
                   "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                         "allgather_partitions": True, "allgather_bucket_size": 2e8,
                                         "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 2e8,
                                         "contiguous_gradients": True},
                   "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
                   "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                   "wall_clock_breakdown": False},
        "refused": ["optimizer.params.lr", "optimizer.params.betas",
                    "optimizer.params.eps", "optimizer.params.weight_decay", "scheduler.params.warmup_min_lr",
                    "scheduler.params.warmup_max_lr", "scheduler.params.warmup_num_steps",
                    "gradient_accumulation_steps", "gradient_clipping", "train_batch_size",
                    "train_micro_batch_size_per_gpu"],
        "fix": "trainer_fill",
    },
    "hf-zero3": {
        "source": HF + "ds_config_zero3.json",
        "config": {"fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                            "hysteresis": 2, "min_loss_scale": 1},
                   "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                         "offload_param": {"device": "cpu", "pin_memory": True},
                                         "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e14,
                                         "reduce_bucket_size": 0, "stage3_prefetch_bucket_size": 0,
                                         "stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 1e9,
                                         "stage3_max_reuse_distance": 1e9,
                                         "stage3_gather_fp16_weights_on_model_save": True},
                   "optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "betas": [0.8, 0.999], "eps": 1e-8,
                                                             "weight_decay": 3e-7}},
                   "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-5,
                                                                "warmup_num_steps": 500}},
                   "steps_per_print": 2000, "wall_clock_breakdown": False},
        # DeepSpeed 0.19.8 refuses 0 too (its ZeRO config requires reduce_bucket_size > 0).
        "refused": ["zero_optimization.reduce_bucket_size"],
        "fix": {"zero_optimization": {"reduce_bucket_size": 5e8}, "train_micro_batch_size_per_gpu": 2},
    },
    "megatron-zero2": {
        "source": DSE + "Megatron-LM/scripts/ds_zero2_config.json",
        "config": {"train_batch_size": 16, "gradient_accumulation_steps": 1, "steps_per_print": 1,
                   "zero_optimization": {"stage": 2}, "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
                   "gradient_clipping": 1.0,
                   "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "hysteresis": 2,
                            "min_loss_scale": 1},
                   "activation_checkpointing": {"partition_activations": True,
                                                "contiguous_memory_optimization": False},
                   "wall_clock_breakdown": False},
        # activation_checkpointing configures zeroedu.checkpointing, as in DeepSpeed: accepted as written
        "refused": [],
    },
    "megatron-zero2-offload": {
        "source": DSE + "Megatron-LM/scripts/ds_zero2_cpu_offload_config.json",
        "config": {"train_batch_size": 16, "gradient_accumulation_steps": 1, "steps_per_print": 1,
                   "zero_optimization": {"stage": 2, "cpu_offload": True},
                   "optimizer": {"type": "Adam", "params": {"lr": 0.00015}}, "gradient_clipping": 1.0,
                   "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "hysteresis": 2,
                            "min_loss_scale": 1},
                   "activation_checkpointing": {"partition_activations": True,
                                                "contiguous_memory_optimization": False},
                   "wall_clock_breakdown": False},
        # cpu_offload is deprecated but DeepSpeed 0.19.8 still maps it to offload_optimizer {"device": "cpu"}: so
        # does zeroedu, with a note (it trains as written, offloaded).
        "refused": [],
    },
    "megatron-zero3": {
        "source": DSE + "Megatron-LM-v1.1.5-ZeRO3/examples/ds_zero_stage_3_config.json (its optimizer is the "
                        "script's own: passed here as a client torch.optim.Adam)",
        "config": {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "steps_per_print": 10,
                   "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e9,
                                         "stage3_max_reuse_distance": 1e9, "stage3_prefetch_bucket_size": 6.039798e7,
                                         "stage3_param_persitence_threshold": 8.192e4,
                                         "reduce_bucket_size": 6.710886e7, "contiguous_gradients": True},
                   "gradient_clipping": 1.0,
                   "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 10, "loss_scale_window": 1000,
                            "hysteresis": 2, "min_loss_scale": 1},
                   "wall_clock_breakdown": True, "zero_allow_untested_optimizer": False},
        # A typo in the original (DeepSpeed 0.19.8 refuses it too: extra keys are forbidden).
        "refused": ["zero_optimization.stage3_param_persitence_threshold"],
        "fix": {"zero_optimization": {"stage3_param_persitence_threshold": None,
                                      "stage3_param_persistence_threshold": 8.192e4}},
        "client_optimizer": 1.5e-4,
    },
    "zero-infinity": {
        "source": DSE + "Megatron-LM-v1.1.5-ZeRO3/examples/ds_zero_stage_infinity_config.json (client optimizer as "
                        "above; nvme_path points at a temporary folder)",
        "config": {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 1,
                   "zero_optimization": {
                       "stage": 3, "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e8,
                       "stage3_param_persitance_threshold": 1e5, "stage3_prefetch_bucket_size": 5e7,
                       "contiguous_gradients": True, "overlap_comm": True, "reduce_bucket_size": 90000000,
                       "sub_group_size": 1e8,
                       "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme_data", "buffer_count": 4,
                                             "pipeline_read": False, "pipeline_write": False, "pin_memory": True},
                       "offload_param": {"device": "nvme", "nvme_path": "/nvme_data", "max_in_cpu": 1,
                                         "pin_memory": True}},
                   "gradient_clipping": 1.0,
                   "fp16": {"enabled": True, "loss_scale": 1024, "loss_scale_window": 1000, "hysteresis": 2,
                            "min_loss_scale": 1},
                   "wall_clock_breakdown": True, "zero_allow_untested_optimizer": False,
                   "aio": {"block_size": 1048576, "queue_depth": 16, "single_submit": False, "overlap_events": True,
                           "thread_count": 2}},
        "refused": ["zero_optimization.stage3_param_persitance_threshold"],
        "fix": {"zero_optimization": {"stage3_param_persitance_threshold": None,
                                      "stage3_param_persistence_threshold": 1e5}},
        "client_optimizer": 1.5e-4,
        "nvme": True,
    },
    "autotuning": {
        "source": DSE + "autotuning/ds_config.json (a config for DeepSpeed's autotuner)",
        "config": {"train_micro_batch_size_per_gpu": [8], "gradient_accumulation_steps": "auto",
                   "gradient_clipping": "auto",
                   "zero_optimization": {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 2e8,
                                         "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 2e8,
                                         "contiguous_gradients": True, "cpu_offload": True},
                   "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                             "weight_decay": "auto"}},
                   "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                                "warmup_num_steps": "auto"}},
                   "autotuning": {"enabled": True, "start_step": 5, "end_step": 10, "num_nodes": 1,
                                  "num_gpus": [2, 4], "metric": "latency",
                                  "arg_mappings": {"train_micro_batch_size_per_gpu": "per_device_train_batch_size"}}},
        "refused": ["train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
                    "optimizer.params.lr", "optimizer.params.betas",
                    "optimizer.params.eps", "optimizer.params.weight_decay", "scheduler.params.warmup_min_lr",
                    "scheduler.params.warmup_max_lr", "scheduler.params.warmup_num_steps", "autotuning"],
    },
    "qanet-onecycle": {
        "source": DSE + "QANet-Pytorch/ds_bsz512_1cycle.json",
        "config": {"train_batch_size": 512, "train_micro_batch_size_per_gpu": 32, "steps_per_print": 10,
                   "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                            "weight_decay": 3e-7}},
                   "scheduler": {"type": "OneCycle", "params": {
                       "cycle_min_lr": 0.004, "cycle_max_lr": 0.015, "cycle_first_step_size": 1000,
                       "cycle_second_step_size": 100, "cycle_first_stair_count": 100,
                       "cycle_second_stair_count": 100, "decay_step_size": 1000, "decay_lr_rate": 0.01}}},
        "refused": [],
    },
    "bert-onebit-adam": {
        "source": DSE + "bing_bert/deepspeed_bsz4k_onebit_config_seq128.json",
        "config": {"train_micro_batch_size_per_gpu": 16, "steps_per_print": 100, "prescale_gradients": False,
                   "optimizer": {"type": "OneBitAdam", "params": {"lr": 4e-4, "weight_decay": 0.01,
                                                                  "bias_correction": False, "freeze_step": 23000,
                                                                  "cuda_aware": True}},
                   "gradient_clipping": 1.0, "wall_clock_breakdown": False,
                   "fp16": {"enabled": True, "loss_scale": 0}},
        "refused": ["optimizer.type"],
    },
    "bert-squad": {
        "source": DSE + "BingBertSquad/deepspeed_bsz24_config.json (written for the old FusedAdam)",
        "config": {"train_batch_size": 24, "train_micro_batch_size_per_gpu": 6, "steps_per_print": 10,
                   "optimizer": {"type": "Adam", "params": {"lr": 3e-5, "max_grad_norm": 1.0, "weight_decay": 0.0,
                                                            "bias_correction": False}},
                   "fp16": {"enabled": True}},
        "refused": ["optimizer.params.max_grad_norm", "optimizer.params.bias_correction"],
        "fix": {"optimizer": {"type": "Adam", "params": {"lr": 3e-5, "weight_decay": 0.0}}, "gradient_clipping": 1.0},
    },
    "llama-factory-z3-offload": {
        "source": "https://github.com/hiyouga/LLaMA-Factory/blob/main/examples/deepspeed/ds_z3_offload_config.json "
                  "(copy seen at huggingface.co/spaces/Justinrune/LLaMA-Factory)",
        "config": {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                   "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                   "zero_allow_untested_optimizer": True,
                   "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                            "hysteresis": 2, "min_loss_scale": 1},
                   "bf16": {"enabled": "auto"},
                   "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                         "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
                                         "contiguous_gradients": True, "sub_group_size": 1e9,
                                         "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                         "stage3_param_persistence_threshold": "auto",
                                         "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                                         "stage3_gather_16bit_weights_on_model_save": True}},
        "refused": ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                    "gradient_clipping"],
        "fix": "trainer_fill",
    },
    # ---- configs of eleven more public projects (issue 30), as their repositories hold them ----------------------
    "axolotl-zero2": {
        "source": "https://github.com/axolotl-ai-cloud/axolotl/blob/58b1d3a4f449cae41d0ef7828b64ea0ea1b27ce2/"
                  "deepspeed_configs/zero2.json (no optimizer: the Trainer's own, a client AdamW here)",
        "config": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                         "contiguous_gradients": True, "overlap_comm": True},
                   "bf16": {"enabled": "auto"},
                   "fp16": {"enabled": "auto", "auto_cast": False, "loss_scale": 0, "initial_scale_power": 32,
                            "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
                   "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
                   "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False},
        "refused": ["gradient_accumulation_steps", "gradient_clipping", "train_batch_size",
                    "train_micro_batch_size_per_gpu"],
        "fix": "trainer_fill", "client_optimizer": 1e-3,
    },
    "fastchat-s2": {
        "source": "https://github.com/lm-sys/FastChat/blob/134fc8d9a30e8d7fb33e2d1acd563c5134e90e78/"
                  "playground/deepspeed_config_s2.json",
        "config": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                         "contiguous_gradients": True, "overlap_comm": True},
                   "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"},
        "refused": ["train_micro_batch_size_per_gpu", "gradient_accumulation_steps"],
        "fix": "trainer_fill", "client_optimizer": 1e-3,
    },
    "stanford-alpaca-offload": {
        "source": "https://github.com/tatsu-lab/stanford_alpaca/blob/3783d185b542c9be78581c5ebc30f7e8688294b2/"
                  "configs/default_offload_opt_param.json",
        "config": {"bf16": {"enabled": "auto"},
                   "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                             "weight_decay": "auto"}},
                   "scheduler": {"type": "WarmupDecayLR", "params": {
                       "total_num_steps": "auto", "warmup_min_lr": "auto", "warmup_max_lr": "auto",
                       "warmup_num_steps": "auto"}},
                   "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                         "offload_param": {"device": "cpu", "pin_memory": True},
                                         "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
                                         "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                         "stage3_param_persistence_threshold": "auto",
                                         "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                                         "stage3_gather_16bit_weights_on_model_save": False},
                   "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 5,
                   "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                   "wall_clock_breakdown": False},
        "refused": ["optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps",
                    "optimizer.params.weight_decay", "scheduler.params.total_num_steps",
                    "scheduler.params.warmup_min_lr", "scheduler.params.warmup_max_lr",
                    "scheduler.params.warmup_num_steps", "gradient_accumulation_steps", "gradient_clipping",
                    "train_batch_size", "train_micro_batch_size_per_gpu"],
        "fix": "trainer_fill",
    },
    "accelerate-zero1": {
        "source": "https://github.com/huggingface/accelerate/blob/1703b79a797dab765996764707186def7533d8fd/"
                  "examples/deepspeed_config_templates/zero_stage1_config.json",
        "config": {"fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                            "hysteresis": 2, "min_loss_scale": 1},
                   "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto",
                                                             "torch_adam": True, "adam_w_mode": True}},
                   "scheduler": {"type": "WarmupDecayLR", "params": {
                       "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
                       "total_num_steps": "auto"}},
                   "zero_optimization": {"stage": 1, "allgather_partitions": True, "allgather_bucket_size": 2e8,
                                         "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": "auto",
                                         "contiguous_gradients": True},
                   "gradient_accumulation_steps": 1, "gradient_clipping": "auto", "steps_per_print": 2000,
                   "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                   "wall_clock_breakdown": False},
        "refused": ["optimizer.params.lr", "optimizer.params.weight_decay", "scheduler.params.warmup_min_lr",
                    "scheduler.params.warmup_max_lr", "scheduler.params.warmup_num_steps",
                    "scheduler.params.total_num_steps", "gradient_clipping", "train_batch_size",
                    "train_micro_batch_size_per_gpu"],
        "fix": "trainer_fill",
    },
    "qwen-zero2": {
        "source": "https://github.com/QwenLM/Qwen/blob/af22d5e0cec7a7c058a445fcc4cb374de960ad5f/"
                  "finetune/ds_config_zero2.json",
        "config": {"fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                            "hysteresis": 2, "min_loss_scale": 1},
                   "bf16": {"enabled": "auto"},
                   "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                             "weight_decay": "auto"}},
                   "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                                "warmup_num_steps": "auto"}},
                   "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none", "pin_memory": True},
                                         "allgather_partitions": True, "allgather_bucket_size": 2e8,
                                         "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 2e8,
                                         "contiguous_gradients": True},
                   "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 100,
                   "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                   "wall_clock_breakdown": False},
        "refused": ["optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps",
                    "optimizer.params.weight_decay", "scheduler.params.warmup_min_lr",
                    "scheduler.params.warmup_max_lr", "scheduler.params.warmup_num_steps",
                    "gradient_accumulation_steps", "gradient_clipping", "train_batch_size",
                    "train_micro_batch_size_per_gpu"],
        "fix": "trainer_fill",
    },
    "chatglm-ptuning": {
        "source": "https://github.com/THUDM/ChatGLM-6B/blob/47a5ec121eb2c092a6347b503eb9f2540595a963/"
                  "ptuning/deepspeed.json (no optimizer: the Trainer's own, a client AdamW here)",
        "config": {"train_micro_batch_size_per_gpu": "auto", "zero_allow_untested_optimizer": True,
                   "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                            "hysteresis": 2, "min_loss_scale": 1},
                   "zero_optimization": {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 5e8,
                                         "overlap_comm": False, "reduce_scatter": True, "reduce_bucket_size": 5e8,
                                         "contiguous_gradients": True}},
        "refused": ["train_micro_batch_size_per_gpu"],
        "fix": "trainer_fill", "client_optimizer": 1e-3,
    },
    "firefly-z3-offload": {
        "source": "https://github.com/yangjianxin1/Firefly/blob/72e8732a8ca03c675ee4b3600c0f314a26dfd0c8/"
                  "train_args/ds_z3_config.json",
        "config": {"gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 200,
                   "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
                   "optimizer": {"type": "Adam", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                            "weight_decay": "auto"}},
                   "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                            "hysteresis": 2, "min_loss_scale": 1},
                   "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                         "offload_param": {"device": "cpu", "pin_memory": True},
                                         "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
                                         "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                         "stage3_param_persistence_threshold": "auto",
                                         "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                                         "stage3_gather_16bit_weights_on_model_save": True},
                   "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                                "warmup_num_steps": "auto"}}},
        "refused": ["gradient_accumulation_steps", "gradient_clipping", "train_batch_size",
                    "train_micro_batch_size_per_gpu", "optimizer.params.lr", "optimizer.params.betas",
                    "optimizer.params.eps", "optimizer.params.weight_decay", "scheduler.params.warmup_min_lr",
                    "scheduler.params.warmup_max_lr", "scheduler.params.warmup_num_steps"],
        "fix": "trainer_fill",
    },
    "minicpm-v-zero2": {
        "source": "https://github.com/OpenBMB/MiniCPM-V/blob/764f50bf7e652c300ed1ac601b43731be39084ec/"
                  "finetune/ds_config_zero2.json",
        "config": {"fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                            "hysteresis": 2, "min_loss_scale": 1},
                   "bf16": {"enabled": "auto"},
                   "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                             "weight_decay": "auto"}},
                   "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none", "pin_memory": True},
                                         "allgather_partitions": True, "allgather_bucket_size": 2e8,
                                         "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 2e8,
                                         "contiguous_gradients": True},
                   "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 100,
                   "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                   "wall_clock_breakdown": False},
        "refused": ["optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps",
                    "optimizer.params.weight_decay", "gradient_accumulation_steps", "gradient_clipping",
                    "train_batch_size", "train_micro_batch_size_per_gpu"],
        "fix": "trainer_fill",
    },
    "internvl-zero1": {
        "source": "https://github.com/OpenGVLab/InternVL/blob/078e90cac07f0a93102baaa6863d87376a5918ca/"
                  "internvl_chat/zero_stage1_config.json (fp16.auto_cast true)",
        "config": {"zero_optimization": {"stage": 1, "allgather_partitions": True, "allgather_bucket_size": 1e9,
                                         "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 1e9,
                                         "contiguous_gradients": True},
                   "fp16": {"enabled": "auto", "auto_cast": True, "loss_scale": 0, "initial_scale_power": 32,
                            "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
                   "bf16": {"enabled": "auto"},
                   "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": [0.9, 0.999], "eps": 1e-8,
                                                             "weight_decay": "auto"}},
                   "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
                   "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                   "wall_clock_breakdown": True},
        "refused": ["optimizer.params.lr", "optimizer.params.weight_decay", "gradient_accumulation_steps",
                    "gradient_clipping", "train_batch_size", "train_micro_batch_size_per_gpu"],
        "fix": "trainer_fill",
    },
    "open-instruct-z3": {
        "source": "https://github.com/allenai/open-instruct/blob/eb00bf13cefacf05b4f99d86ad7ef3015af91050/"
                  "configs/ds_configs/stage3_no_offloading_accelerate.conf (no optimizer: a client AdamW here)",
        "config": {"bf16": {"enabled": "auto"},
                   "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                                         "sub_group_size": 1e9, "reduce_bucket_size": "auto",
                                         "stage3_prefetch_bucket_size": "auto",
                                         "stage3_param_persistence_threshold": "auto",
                                         "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                                         "stage3_gather_16bit_weights_on_model_save": True},
                   "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 1e5,
                   "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                   "wall_clock_breakdown": False},
        "refused": ["gradient_accumulation_steps", "gradient_clipping", "train_batch_size",
                    "train_micro_batch_size_per_gpu"],
        "fix": "trainer_fill", "client_optimizer": 1e-3,
    },
    "ms-swift-zero3": {
        "source": "https://github.com/modelscope/ms-swift/blob/35992c1cc9092af233edbd75a2aefcd496d6fc19/"
                  "swift/llm/ds_config/zero3.json (no optimizer: a client AdamW here)",
        "config": {"fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                            "hysteresis": 2, "min_loss_scale": 1},
                   "bf16": {"enabled": "auto"},
                   "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none", "pin_memory": True},
                                         "offload_param": {"device": "none", "pin_memory": True},
                                         "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
                                         "reduce_bucket_size": "auto", "zero_quantized_weights": False,
                                         "zero_quantized_gradients": False, "stage3_prefetch_bucket_size": "auto",
                                         "stage3_param_persistence_threshold": "auto",
                                         "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                                         "stage3_gather_16bit_weights_on_model_save": True},
                   "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
                   "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                   "wall_clock_breakdown": False},
        "refused": ["gradient_accumulation_steps", "gradient_clipping", "train_batch_size",
                    "train_micro_batch_size_per_gpu"],
        "fix": "trainer_fill", "client_optimizer": 1e-3,
    },
}

# What the HF Trainer writes for "auto" with `--per_device_train_batch_size 4 --learning_rate 5e-5 --warmup_steps 10
# --bf16` on 2 ranks, and a model of hidden size 64 (the HF DeepSpeed docs list each key's source).
TRAINER = {
    "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "train_batch_size": 8,
    "gradient_clipping": 1.0, "fp16.enabled": False, "bf16.enabled": True,
    "optimizer.params.lr": 5e-5, "optimizer.params.betas": [0.9, 0.999], "optimizer.params.eps": 1e-8,
    "optimizer.params.weight_decay": 0.0, "scheduler.params.warmup_min_lr": 0.0,
    "scheduler.params.warmup_max_lr": 5e-5, "scheduler.params.warmup_num_steps": 10,
    "scheduler.params.total_num_steps": 100,
    "zero_optimization.reduce_bucket_size": 64 * 64,
    "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * 64 * 64),
    "zero_optimization.stage3_param_persistence_threshold": 10 * 64,
}


def trainer_fill(config: dict, prefix: str = "") -> dict:
    """The config with every "auto" replaced as the Trainer would (TRAINER)."""
    out = {}
    for key, value in config.items():
        where = f"{prefix}.{key}" if prefix else key
        out[key] = trainer_fill(value, where) if isinstance(value, dict) else TRAINER[where] if value == "auto" \
            else value
    return out


def apply_fix(config: dict, fix: dict) -> dict:
    """config with fix merged in (None removes a key)."""
    out = copy.deepcopy(config)
    for key, value in fix.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict) and key != "optimizer":
            out[key] = apply_fix(out[key], value)
        else:
            out[key] = value
    return out


def runnable(name: str, nvme_dir: str | None = None) -> dict:
    """The config that must train: as written, or after its fix."""
    entry = CORPUS[name]
    fix = entry.get("fix")
    cfg = trainer_fill(entry["config"]) if fix == "trainer_fill" else apply_fix(entry["config"], fix or {})
    if entry.get("nvme"):
        for tier in ("offload_optimizer", "offload_param"):
            cfg["zero_optimization"][tier]["nvme_path"] = nvme_dir
    return cfg
