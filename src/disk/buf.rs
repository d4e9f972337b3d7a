//! [`AlignedBuf`]: heap memory aligned for O_DIRECT, and the [`IoBuf`] / [`IoBufMut`] traits
//! through which a caller's own buffers go to the kernel.

use std::alloc::{self, Layout};
use std::any::Any;
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

use crate::DiskError;

/// The alignment of every O_DIRECT buffer, offset and length here: 4 KiB, the page size and the
/// largest logical block size of common disks (512-byte-sector disks accept it too).
pub const ALIGN: usize = 4096;

/// A zero-initialised byte buffer whose address and length are multiples of [`ALIGN`], as
/// O_DIRECT needs.
///
/// Invariants: `ptr` comes from the global allocator with `Layout { size: len, align: ALIGN }`,
/// `len > 0`, `len % ALIGN == 0`, and the memory is initialised (zeroed at allocation). The
/// buffer owns its memory uniquely; reads and writes in flight own the buffer (they take it by
/// value and give it back), so the kernel never writes memory that safe code can see.
///
/// ```
/// use iothrottle::disk::{AlignedBuf, ALIGN};
///
/// let mut buf = AlignedBuf::zeroed(2 * ALIGN)?;
/// buf[..5].copy_from_slice(b"hello");
/// assert_eq!(buf.as_ptr() as usize % ALIGN, 0);
/// assert!(AlignedBuf::zeroed(1000).is_err()); // not a multiple of 4 KiB
/// # Ok::<(), iothrottle::DiskError>(())
/// ```
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    /// `Some` for a crate-internal view of a caller's buffer ([`AlignedBuf::lend`]): the memory
    /// belongs to the buffer in the box, which this value keeps alive and drops instead of
    /// freeing `ptr`. Such a view is only handed to the backends and never dereferenced (its
    /// bytes may be uninitialised).
    lent: Option<Lent>,
}

/// The owner of a lent buffer's memory (a caller's [`IoBuf`]).
struct Lent(Box<dyn Any + Send>);

// SAFETY: a `Lent` is never accessed through a shared reference (only moved, dropped, or taken
// back by value once unique), so sharing `&Lent` between threads shares nothing.
unsafe impl Sync for Lent {}

// SAFETY: `AlignedBuf` owns its allocation uniquely (like `Box<[u8]>`); moving it to another
// thread moves that ownership.
unsafe impl Send for AlignedBuf {}
// SAFETY: `&AlignedBuf` only gives `&[u8]` (shared, immutable) access, like `&Box<[u8]>`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes; `len` must be a positive multiple of [`ALIGN`].
    pub fn zeroed(len: usize) -> Result<Self, DiskError> {
        check_len(len)?;
        let layout =
            Layout::from_size_align(len, ALIGN).map_err(|_| DiskError::OffsetOverflow {
                offset: 0,
                len: len as u64,
            })?;
        // SAFETY: `layout` has a non-zero size (checked by `check_len`).
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            alloc::handle_alloc_error(layout)
        };
        Ok(AlignedBuf {
            ptr,
            len,
            lent: None,
        })
    }

    /// A buffer holding a copy of `data`, whose length must be a positive multiple of [`ALIGN`].
    pub fn from_slice(data: &[u8]) -> Result<Self, DiskError> {
        let mut buf = Self::zeroed(data.len())?;
        buf.copy_from_slice(data);
        Ok(buf)
    }

    /// Length in bytes (a positive multiple of [`ALIGN`]).
    #[allow(clippy::len_without_is_empty)] // never empty
    pub fn len(&self) -> usize {
        self.len
    }

    /// The start of the buffer, for the kernel. Valid while `self` lives and is not moved
    /// out of... the heap memory does not move when the `AlignedBuf` value does.
    pub(crate) fn raw(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// A view of `len` bytes at `ptr`, which `owner` keeps alive and stable (an [`IoBuf`]'s
    /// memory), for the backends. Never dereferenced: see the `lent` field.
    ///
    /// # Safety
    /// `ptr` is valid for `len` bytes for as long as `owner` lives, and does not move when
    /// `owner` does (the [`IoBuf`] contract).
    pub(crate) unsafe fn lend<B: Send + 'static>(owner: B, ptr: *mut u8, len: usize) -> Self {
        AlignedBuf {
            ptr: NonNull::new(ptr).expect("a stable pointer is not null"),
            len,
            lent: Some(Lent(Box::new(owner))),
        }
    }

    /// `true` for a view made by [`lend`](Self::lend).
    pub(crate) fn is_lent(&self) -> bool {
        self.lent.is_some()
    }

    /// The caller's buffer back from a view made by [`lend`](Self::lend), or `Err(self)` for
    /// an owned buffer.
    pub(crate) fn unlend<B: 'static>(mut self) -> Result<B, Self> {
        match self.lent.take() {
            Some(Lent(owner)) => {
                // Disarm the drop: the memory is the owner's, not ours.
                std::mem::forget(self);
                Ok(*owner
                    .downcast::<B>()
                    .expect("a view is taken back as the type it was lent as"))
            }
            None => Err(self),
        }
    }
}

/// A buffer the kernel may read from while it is moved into an I/O call (tokio-uring's `IoBuf`
/// convention): its memory stays put while the value moves, and its first
/// [`bytes_init`](Self::bytes_init) bytes are initialised.
///
/// A write writes `stable_ptr()..stable_ptr() + bytes_init()`; a read (through [`IoBufMut`])
/// fills `stable_mut_ptr()..stable_mut_ptr() + bytes_total()`. With `O_DIRECT` the address and
/// the length must be multiples of [`ALIGN`]: [`ThrottledFile`](super::ThrottledFile) checks
/// both and answers [`DiskError::Unaligned`] (`what: "buffer address"` / `"buffer length"`),
/// handing the buffer back. [`AlignedBuf`] always fits; a `Vec<u8>` fits when its allocation
/// happens to be aligned.
///
/// # Safety
/// `stable_ptr` must point to at least `bytes_total()` bytes that stay valid, and at the same
/// address, until the value is dropped, however it is moved; the first `bytes_init()` of them
/// are initialised.
pub unsafe trait IoBuf: Unpin + Send + 'static {
    /// The start of the memory; stable while the value lives.
    fn stable_ptr(&self) -> *const u8;
    /// How many bytes from the start are initialised (what a write writes).
    fn bytes_init(&self) -> usize;
    /// How many bytes the memory holds (what a read fills).
    fn bytes_total(&self) -> usize;
}

/// A buffer the kernel may write into (tokio-uring's `IoBufMut` convention).
///
/// # Safety
/// As [`IoBuf`]; `stable_mut_ptr` returns the same address as `stable_ptr`, and `set_init`
/// records that the first `pos` bytes are initialised.
pub unsafe trait IoBufMut: IoBuf {
    /// The start of the memory, for writing.
    fn stable_mut_ptr(&mut self) -> *mut u8;
    /// Records that the first `pos` bytes are initialised (a read filled them).
    ///
    /// # Safety
    /// The first `pos` bytes must really be initialised.
    unsafe fn set_init(&mut self, pos: usize);
}

// SAFETY: the heap allocation does not move with the value; all `len` bytes are initialised.
unsafe impl IoBuf for AlignedBuf {
    fn stable_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.len
    }
    fn bytes_total(&self) -> usize {
        self.len
    }
}

// SAFETY: as above; the memory is always fully initialised, so `set_init` has nothing to do.
unsafe impl IoBufMut for AlignedBuf {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    unsafe fn set_init(&mut self, _pos: usize) {}
}

// SAFETY: a `Vec`'s heap buffer does not move when the `Vec` does; `len` bytes are initialised
// and `capacity` allocated.
unsafe impl IoBuf for Vec<u8> {
    fn stable_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.len()
    }
    fn bytes_total(&self) -> usize {
        self.capacity()
    }
}

// SAFETY: as above; `set_init` only grows the length over bytes the caller says are written.
unsafe impl IoBufMut for Vec<u8> {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
    unsafe fn set_init(&mut self, pos: usize) {
        if self.len() < pos {
            // SAFETY: `pos <= capacity` (a read fills at most `bytes_total`) and the caller
            // guarantees the bytes are initialised.
            unsafe { self.set_len(pos) }
        }
    }
}

// SAFETY: a boxed slice's memory does not move with the box and is fully initialised.
unsafe impl IoBuf for Box<[u8]> {
    fn stable_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.len()
    }
    fn bytes_total(&self) -> usize {
        self.len()
    }
}

// SAFETY: as above; always fully initialised.
unsafe impl IoBufMut for Box<[u8]> {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
    unsafe fn set_init(&mut self, _pos: usize) {}
}

/// Checks an O_DIRECT buffer's address.
pub(crate) fn check_addr(ptr: *const u8) -> Result<(), DiskError> {
    let addr = ptr as usize;
    if !addr.is_multiple_of(ALIGN) {
        return Err(DiskError::Unaligned {
            what: "buffer address",
            value: addr as u64,
            align: ALIGN as u64,
        });
    }
    Ok(())
}

/// Checks an O_DIRECT transfer length.
pub(crate) fn check_len(len: usize) -> Result<(), DiskError> {
    if len == 0 {
        return Err(DiskError::EmptyBuffer);
    }
    if !len.is_multiple_of(ALIGN) {
        return Err(DiskError::Unaligned {
            what: "buffer length",
            value: len as u64,
            align: ALIGN as u64,
        });
    }
    Ok(())
}

impl Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        debug_assert!(self.lent.is_none(), "a lent view is never dereferenced");
        // SAFETY: `ptr` is valid for `len` initialised bytes (type invariant) and `&self`
        // guarantees no mutable access for the borrow's lifetime.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.lent.is_some() {
            // A view: the owner (dropped with the field) frees its own memory.
            return;
        }
        // SAFETY: allocated in `zeroed` with exactly this layout (type invariant), freed once.
        unsafe {
            alloc::dealloc(
                self.ptr.as_ptr(),
                Layout::from_size_align_unchecked(self.len, ALIGN),
            )
        }
    }
}

impl fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_zeroed() {
        for n in [1, 2, 16, 256] {
            let b = AlignedBuf::zeroed(n * ALIGN).unwrap();
            assert_eq!(b.as_ptr() as usize % ALIGN, 0);
            assert_eq!(b.len(), n * ALIGN);
            assert!(b.iter().all(|&x| x == 0));
        }
    }

    #[test]
    fn a_vec_reads_into_its_capacity_and_grows_by_what_was_read() {
        let mut v: Vec<u8> = Vec::with_capacity(2 * ALIGN);
        v.extend_from_slice(&[1; 100]);
        assert_eq!((v.bytes_init(), v.bytes_total()), (100, v.capacity()));
        assert_eq!(v.stable_mut_ptr().cast_const(), v.stable_ptr());
        // SAFETY: the first 100 bytes are initialised; a smaller count changes nothing.
        unsafe { v.set_init(50) };
        assert_eq!(v.len(), 100);
        v.spare_capacity_mut()[..ALIGN - 100].fill(std::mem::MaybeUninit::new(2));
        // SAFETY: the first ALIGN bytes are now initialised.
        unsafe { v.set_init(ALIGN) };
        assert_eq!(v.len(), ALIGN);
        assert!(v[100..].iter().all(|&b| b == 2));
        let b: Box<[u8]> = vec![0; ALIGN].into_boxed_slice();
        assert_eq!((b.bytes_init(), b.bytes_total()), (ALIGN, ALIGN));
    }

    #[test]
    fn a_lent_view_gives_the_owner_back_and_an_owned_buffer_stays_itself() {
        let mut owner = vec![0u8; ALIGN];
        let ptr = owner.as_mut_ptr();
        // SAFETY: `ptr` is `owner`'s heap memory, which moves with it into the view.
        let view = unsafe { AlignedBuf::lend(owner, ptr, ALIGN) };
        assert!(view.is_lent());
        let back: Vec<u8> = view.unlend().expect("a view");
        assert_eq!(back.as_ptr(), ptr.cast_const());
        let own = AlignedBuf::zeroed(ALIGN).unwrap();
        assert!(!own.is_lent());
        assert!(own.unlend::<Vec<u8>>().is_err());
        assert!(matches!(
            check_addr(ptr.wrapping_add(1)),
            Err(DiskError::Unaligned {
                what: "buffer address",
                ..
            })
        ));
    }

    #[test]
    fn bad_lengths_are_typed_errors() {
        assert!(matches!(AlignedBuf::zeroed(0), Err(DiskError::EmptyBuffer)));
        assert!(matches!(
            AlignedBuf::zeroed(4095),
            Err(DiskError::Unaligned {
                what: "buffer length",
                value: 4095,
                align: 4096
            })
        ));
        assert!(matches!(
            AlignedBuf::from_slice(&[1; 512]),
            Err(DiskError::Unaligned { value: 512, .. })
        ));
        let b = AlignedBuf::from_slice(&[7; ALIGN]).unwrap();
        assert!(b.iter().all(|&x| x == 7));
    }
}
