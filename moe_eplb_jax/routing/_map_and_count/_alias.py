"""Walker's alias table of mode ``"lp"``: each entry's slot from one or two table words, for :mod:`.map_and_count`.

An expert with ``c`` replicas gets ``c`` buckets of ``U = 2**UNIT_BITS`` mass
units. Its float weights become integer masses summing to ``c * U``
(:func:`integer_masses`), and Vose's sweep fills the buckets (:func:`row_words`,
in closed form): bucket ``b`` keeps replica ``b`` for ``prob_b`` units and sends
the rest to one other replica, its alias. An entry's token hash picks a bucket
and a fraction of it (:func:`bucket_and_fraction`), so the map kernel does
constant work per entry. Everything here is integer jnp work, so every
implementation -- the reference, the Pallas kernel that builds the table per
call (:mod:`._alias_kernel`), a table prepared once per placement -- gives the
same words bit for bit. Shapes: weights and words ``[E, S]``; the kernel's
packed layout is flat (:func:`pack_words`). The construction: docs/kernels.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = [
    "weight_bits",
    "integer_masses",
    "alias_words",
    "pack_words",
    "packed_size",
    "slot_bits",
    "head_word",
    "alias_head",
    "head_fields",
    "word_heads_fit",
    "bucket_and_fraction",
    "alias_slot",
    "compact_words",
    "compact_slot",
    "compact_fits",
    "MAX_WIDTH",
    "MAX_SLOTS",
    "COMPACT_SLOTS",
    "UNIT_BITS",
    "HEAD_SHIFT",
]

# U = 2**10 mass units per bucket (shares followed to within 2**-10 of a bucket, far below a batch's routing noise):
# prob fits 10 bits, so with up to 2047 slots a bucket's prob and both its slots share one word (compact_words).
UNIT_BITS = 10
MAX_WIDTH = 0x7FFF  # replicas per expert: the count fills a head word's top 15 bits (HEAD_SHIFT)
MAX_SLOTS = 0xFFFF  # physical slots: the alias slot fills the word's low 16 bits
COMPACT_SLOTS = 0x7FF  # up to this many physical slots a bucket is one word: prob << 22 | alias << 11 | own
HEAD_SHIFT = 17  # an alias head: count (< 2**15) << 17 | 17 low bits (first slot + 1, or the bucket offset)
_SIGNIFICAND = (1 << 23) - 1


def weight_bits(width: int) -> int:
    """``B``: the largest weight of a row becomes an integer in ``[2**(B-1), 2**B)``; ``c * q`` and the row's
    sum of ``width`` of them stay below ``2**30`` (so the long division's doubled remainder fits int32)."""
    return min(24, 30 - (int(width) - 1).bit_length())


def live_counts(logcnt, width):
    """The replica counts the table uses: ``logcnt`` clipped to ``[1, width]``."""
    return jnp.clip(logcnt, 1, width)


def _significand(bits):
    """The integer significand ``M`` of non-negative float32 bit patterns (the implicit bit of normal ones)."""
    return (bits & _SIGNIFICAND) | ((bits >> 23) > 0).astype(jnp.int32) << 23


def _integer_weights(values, live, width):
    """``q_j = floor(w_j * 2**k)`` (module docstring) from the float32 bit patterns: shifts only.

    Integer tests throughout, even which weights count: float compares may treat subnormals as zero on one
    backend and not on another (XLA on CPU does)."""
    bits = jax.lax.bitcast_convert_type(values.astype(jnp.float32), jnp.int32)
    # Positive and finite: above +0 and below +inf's pattern (negatives have the sign bit: below 0; NaN above).
    bits = jnp.where(live & (bits > 0) & (bits < 0x7F800000), bits, 0)  # >= 0, ordered as the weights are
    exponent = jnp.maximum(bits >> 23, 1)  # subnormals scale as exponent field 1, without the implicit bit
    significand = _significand(bits)
    top = jnp.max(bits, axis=-1, keepdims=bits.ndim > 1)
    top_exponent = jnp.maximum(top >> 23, 1)
    top_length = 32 - jax.lax.clz(_significand(top))  # bit length
    # q = M * 2**(e - e_top - len(M_top) + B): a right shift, or a left one for a subnormal largest weight.
    right = top_exponent - exponent + top_length - weight_bits(width)
    shifted_right = jax.lax.shift_right_logical(significand, jnp.clip(right, 0, 31))
    shifted_left = jax.lax.shift_left(significand, jnp.clip(-right, 0, 31))
    return jnp.where(top > 0, jnp.where(right >= 0, shifted_right, shifted_left), 0)


def integer_masses(values, index, count, width):
    """One row's (or ``[E, S]`` rows') integer masses (module docstring), lanes ``index``, summing to
    ``count * U`` over the live lanes (``count`` a scalar or ``[E, 1]``); 0 past the count."""
    unit = 1 << UNIT_BITS
    live = index < count
    quanta = _integer_weights(values, live, width)
    rows = index.ndim > 1  # keep the row axis
    total = jnp.sum(quanta, axis=-1, keepdims=rows)  # Q < 2**30
    last = jnp.max(jnp.where(quanta > 0, index, -1), axis=-1, keepdims=rows)  # -1: Q = 0
    # floor(count * q * U / Q): the integer part of count * q / Q, then UNIT_BITS quotient bits one at a time
    # (the remainder stays below Q < 2**30, so doubling it fits int32).
    divisor = jnp.maximum(total, 1)
    scaled = count * quanta  # < 2**30
    quotient, remainder = jax.lax.div(scaled, divisor), jax.lax.rem(scaled, divisor)
    for _ in range(UNIT_BITS):
        remainder = remainder << 1
        carry = remainder >= divisor
        quotient = (quotient << 1) | carry.astype(jnp.int32)
        remainder = jnp.where(carry, remainder - divisor, remainder)
    floors = jnp.where(live & (index != last), quotient, 0)
    masses = jnp.where(index == last, count * unit - jnp.sum(floors, axis=-1, keepdims=rows), floors)
    return jnp.where(total > 0, masses, jnp.where(live, unit, 0))


def _count_at_most(read, queries, count, steps):
    """``#{i < count : row_i <= q}`` per query of a non-decreasing row (``read(i)`` gathers it), by bisection
    in ``steps`` steps (enough for ``count``)."""

    def step(_, bounds):
        low, high = bounds
        middle = (low + high) >> 1
        passed = (low < high) & (read(middle) <= queries)
        return jnp.where(passed, middle + 1, low), jnp.where(passed | (low >= high), high, middle)

    low = jnp.zeros_like(queries)
    return jax.lax.fori_loop(0, steps, step, (low, jnp.zeros_like(queries) + count))[0]


def row_words(masses, slots, index, count, read_from, steps):
    """One row's (or rows') alias words (:func:`alias_words`), lanes ``index``, from its masses and the slots of
    its replicas; ``read_from(row)`` gives a gather from a row's values for :func:`_count_at_most`."""
    unit = 1 << UNIT_BITS
    live = index < count
    light = live & (masses < unit)
    heavy = live & (masses > unit)
    deficit = jnp.where(light, unit - masses, 0)
    excess = jnp.where(heavy, masses - unit, 0)
    deficit_end = jnp.cumsum(deficit, axis=-1)  # inclusive; exact integers below 2**31
    excess_end = jnp.cumsum(excess, axis=-1)
    after_excess = read_from(excess_end)
    # A light's alias: the first heavy whose excess interval ends past the light's deficit start.
    light_alias = _count_at_most(after_excess, deficit_end - deficit, count, steps)
    # A heavy's own bucket gives up what the light crossing its end still needs: the first light end at or past
    # it, minus it (0 for the last heavy, whose end is the total); the next heavy fills that part.
    crossing = jnp.minimum(_count_at_most(read_from(deficit_end), excess_end - 1, count, steps), count - 1)
    overshoot = read_from(deficit_end)(crossing) - excess_end
    heavy_alias = _count_at_most(after_excess, excess_end, count, steps)
    prob = jnp.where(light, jnp.maximum(masses, 0), jnp.where(heavy, unit - overshoot, unit))
    alias = jnp.where(light, light_alias, jnp.where(heavy & (prob < unit), heavy_alias, index))
    alias = jnp.clip(alias, 0, count - 1)  # (already inside for exact totals)
    prob = jnp.where(prob >= unit, 0, prob)  # keeps everything: the alias is its own slot
    return jnp.where(live, (prob << 16) | slot_bits(read_from(slots)(alias)), 0)


def slot_bits(slots, mark=MAX_SLOTS):
    """Slots as a word's field: ``mark`` (``0xFFFF`` for 16 bits, never below ``num_physical <= 65535``:
    unmapped, -1; ``COMPACT_SLOTS`` for 11) for any slot outside ``[0, mark)``, so an invalid slot cannot wrap
    onto a valid one."""
    return jnp.where((slots >= 0) & (slots < mark), slots, mark)


def _first_slot_field(first_slot):
    """A head's 16-bit ``first slot + 1``: 0 (unmapped) for a first slot outside ``[0, 0xFFFF)``."""
    return (slot_bits(first_slot) + 1) & 0xFFFF


def head_word(first_slot, count):
    """A head of the placement lookup table (:func:`._tables.placement_lookup`): ``(first slot + 1) | count << 16``
    (``count < 2**16``: read with a logical shift), the first slot ``-1`` (unmapped) outside ``[0, 0xFFFF)``."""
    return _first_slot_field(first_slot) | (count << 16)


def alias_head(first_slot, count, offset):
    """An expert's head word in the alias table: ``count << 17 | low``, ``low`` its first slot + 1 (0: unmapped,
    as :func:`head_word`) for a single-replica expert, else the low 17 bits of its bucket offset -- the whole
    offset where the table has at most ``2**17`` buckets (:func:`word_heads_fit`), so that one load gives an
    entry what it needs."""
    low = jnp.where(count == 1, _first_slot_field(first_slot), offset & ((1 << HEAD_SHIFT) - 1))
    return low | (count << HEAD_SHIFT)  # (wraps into the sign bit from 2**14 buckets: read with a logical shift)


def head_fields(head):
    """``(count, low)`` of :func:`alias_head` words."""
    return jax.lax.shift_right_logical(head, HEAD_SHIFT), head & ((1 << HEAD_SHIFT) - 1)


def word_heads_fit(num_logical: int, width: int) -> bool:
    """Whether every bucket offset of a ``[num_logical, width]`` table fits a head word's low bits (the
    offsets stay below ``num_logical * width``)."""
    return num_logical * width <= 1 << HEAD_SHIFT


def alias_words(values, log2phy, logcnt):
    """The alias table ``[E, S]`` int32 of mode ``"lp"`` in jnp (the reference of :mod:`._alias_kernel`).

    ``values [E, S]`` the raw weights, ``log2phy [E, S]`` the replicas' slots.
    Word ``b`` of a live bucket: ``prob << 16 | slot of alias_b`` -- the
    bucket keeps its own replica ``b`` for fractions below ``prob``
    (``0 <= prob < U``) and sends the rest to the alias; a bucket that keeps
    all of its mass has ``prob = 0`` and its own slot as the alias. Entries
    past the count are 0.
    """
    width = log2phy.shape[1]
    count = live_counts(logcnt, width)[:, None]
    index = jnp.arange(width, dtype=jnp.int32)[None, :]
    masses = integer_masses(values, index, count, width)
    read_from = lambda row: lambda at: jnp.take_along_axis(row, jnp.clip(at, 0, width - 1), axis=1)
    return row_words(masses, log2phy, index, count, read_from, int(width).bit_length())


def packed_size(num_logical: int, width: int, compact: bool = False) -> int:
    """Entries of the packed table (:func:`pack_words`) of ``[num_logical, width]`` words."""
    return 2 * num_logical + (1 if compact else 2) * num_logical * width


def compact_fits(num_physical: int) -> bool:
    """Whether a bucket's slots fit :func:`compact_words`' 11 bits (0x7FF itself stays the unmapped mark)."""
    return num_physical <= COMPACT_SLOTS


def compact_words(words, own_slots):
    """Buckets as one word each, ``prob << 22 | alias slot << 11 | own slot`` (slots outside ``[0, 0x7FF)``
    as 0x7FF, never below ``num_physical <= 2047``: unmapped), from :func:`alias_words`' words and the buckets'
    own slots."""
    prob = jax.lax.shift_right_logical(words, 16)  # < U
    return (prob << 22) | (slot_bits(words & 0xFFFF, COMPACT_SLOTS) << 11) | slot_bits(own_slots, COMPACT_SLOTS)


def compact_slot(word, fraction):
    """The slot of a :func:`compact_words` word for a fraction of its bucket (0x7FF: unmapped)."""
    keep = fraction < jax.lax.shift_right_logical(word, 22)
    return jnp.where(keep, word & COMPACT_SLOTS, (word >> 11) & COMPACT_SLOTS)


def pack_words(words, log2phy, logcnt, compact=False):
    """The map kernel's layout of the alias table: flat int32 ``[2 E + 2 E S]`` (``compact``: ``[2 E + E S]``).

    Per expert a head pair, :func:`alias_head` (``count`` its buckets,
    :func:`live_counts`, and the first slot + 1 or the offset) and ``offset``
    (the earlier experts' counts summed: the map kernel reads the head alone
    where :func:`word_heads_fit`); then from entry ``2 E`` on, bucket by
    bucket in expert order, ``(word, own slot)`` -- or with ``compact``
    (``num_physical <= 2047``) one :func:`compact_words` word; the rest is 0.
    An entry reads its expert's head, then -- for a multi-replica expert --
    its bucket: the live buckets number about ``P``, so a few KB are in use
    whatever the table's width.
    """
    num_logical, width = words.shape
    log2phy = log2phy.astype(jnp.int32)
    count = live_counts(logcnt, width)
    offset = jnp.cumsum(count) - count
    heads = jnp.stack([alias_head(log2phy[:, 0], count, offset), offset], axis=1).reshape(-1)
    index = jnp.arange(width, dtype=jnp.int32)[None, :]
    at = jnp.where(index < count[:, None], offset[:, None] + index, num_logical * width)  # dead lanes: a spare row
    if compact:
        buckets = compact_words(words, log2phy)[..., None]
    else:
        buckets = jnp.stack([words, log2phy], axis=-1)
    buckets = buckets.reshape(-1, buckets.shape[-1])
    packed = jnp.zeros((num_logical * width + 1, buckets.shape[-1]), jnp.int32).at[at.reshape(-1)].set(buckets)
    return jnp.concatenate([heads, packed[:-1].reshape(-1)])


def bucket_and_fraction(hashed, count):
    """``(bucket, fraction)`` int32 of uint32 hashes for ``count`` buckets of ``U`` units (``count < 2**16``).

    ``s = floor(h * count / 2**16)`` in uint32 (``h`` split in 16-bit halves),
    ``bucket = s >> 16`` (uniform over ``[0, count)``), ``fraction = (s mod
    2**16) >> 6`` (uniform over ``[0, U)``).
    """
    scale = count.astype(jnp.uint32)
    scaled = (hashed >> 16) * scale + (((hashed & 0xFFFF) * scale) >> 16)
    return (scaled >> 16).astype(jnp.int32), ((scaled & 0xFFFF) >> (16 - UNIT_BITS)).astype(jnp.int32)


def alias_slot(word, own_slot, fraction):
    """The slot of a bucket's word (:func:`alias_words`) for a fraction of the bucket whose own replica's slot is
    ``own_slot``."""
    return jnp.where(fraction < jax.lax.shift_right_logical(word, 16), own_slot, word & 0xFFFF)
