"""The runtime's changes to Megatron's code (runtime/patches.py): each one's target is where the
patch expects it in the installed megatron-core, with the parameters it relies on; a target that
moved or changed is a clear error naming the patch, not a patch that quietly stops working."""
from conftest import require_modules

require_modules("torch", "megatron.core")

import pytest  # noqa: E402

from megatron_skill.runtime import patches  # noqa: E402


@pytest.mark.parametrize("patch", patches.registry(), ids=lambda p: p.name.split(":")[0])
def test_every_target_is_what_its_patch_was_written_for(patch):
    patch.check()


def test_a_moved_or_changed_target_is_a_clear_error():
    base = patches.by_name("RoPE")
    moved = patches.Patch(base.name, base.target + "_renamed", base.install)
    with pytest.raises(patches.PatchError, match="RoPE.*_apply_rotary_pos_emb_bshd_renamed.*has moved"):
        moved.apply()
    changed = patches.Patch(base.name, base.target, base.install, parameters=("t", "freqs", "cu_seqlens_q"))
    with pytest.raises(patches.PatchError, match="no longer takes cu_seqlens_q"):
        changed.apply()
    newer = patches.Patch(base.name, base.target, base.install, versions=((">=", "0.21"),))
    with pytest.raises(patches.PatchError, match="was written for megatron-core >=0.21"):
        newer.check()


def test_patches_apply_once():
    """Applying twice leaves one wrapper (the entry script and the CPU loop may both ask)."""
    from megatron.core.models.common.embeddings import rope_utils

    rope = patches.by_name("RoPE")
    assert rope.apply()
    first = rope_utils._apply_rotary_pos_emb_bshd
    assert rope.apply() and rope_utils._apply_rotary_pos_emb_bshd is first
    from megatron_skill.runtime import fused_rope
    fused_rope.uninstall()
