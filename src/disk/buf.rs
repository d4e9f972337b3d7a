//! [`AlignedBuf`]: heap memory aligned for O_DIRECT.

use std::alloc::{self, Layout};
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

use crate::error::DiskError;

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
}

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
        Ok(AlignedBuf { ptr, len })
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
