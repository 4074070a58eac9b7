"""The ground floor: leaf helpers every other part of moe_lab may use, which import nothing else of moe_lab.

- :mod:`.atomic`: atomic writes of files and directories (nothing half-written is ever read);
- :mod:`.precision`: master weights and the export dtype (``method.master_weights``);
- :mod:`.plain`: OmegaConf containers to plain Python values;
- :mod:`.export_check`: the manifest names of compression exports, and the refusal of an export cut short;
- :mod:`.task_table`: one row per ``task=X`` (its run, whether it trains, how it resumes, its manifest, its maps).
- :mod:`.stamped_log`: the resumable logs of finished work, stamped with their settings (CSV points, JSONL records);
- :mod:`.method_class`: the LightningModule class a method config names, whose class attributes are its facts;
- :mod:`.settings`: the typed optimizer, schedule, training loop and run length;
- :mod:`.registration`: the decorator every registration table is filled with (a key taken twice is refused).
"""
