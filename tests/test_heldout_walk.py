"""dflash.train.walk's bookkeeping: which store sample each served prompt is, and which checkpoint
each served export came from (the walk itself: tests/test_labels.py and tests/test_recipe.py)."""

import pytest

from dflash.train import walk as heldout_walk
from dflash.train.checkpoint import STATE_NAME, step_dir_name


def test_served_prompts_name_their_held_out_samples():
    result = {"per_prompt": [{"prompt_id": "row 17 (sample 4)"}, {"prompt_id": "row 3 (sample 120)"}]}
    assert heldout_walk.served_samples(result) == [4, 120]
    with pytest.raises(ValueError, match="--prompts heldout"):
        heldout_walk.served_samples({"per_prompt": [{"prompt_id": "row 17"}]})  # a data source's row


def test_each_export_maps_to_its_checkpoint(tmp_path):
    for step in (2, 4):
        (tmp_path / step_dir_name(step)).mkdir()
        (tmp_path / step_dir_name(step) / STATE_NAME).write_text("{}")
    (tmp_path / step_dir_name(6)).mkdir()  # incomplete: no state file
    assert heldout_walk.checkpoint_for("/w/export-00000002", tmp_path) == tmp_path / step_dir_name(2)
    assert heldout_walk.checkpoint_for("/w/export/", tmp_path) == tmp_path / step_dir_name(4)  # the last complete
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        heldout_walk.checkpoint_for("/w/export-00000003", tmp_path)
