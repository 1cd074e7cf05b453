// Finds libdayzero without crates from a registry: DAYZERO_LIB_DIR if set,
// else `pkg-config --libs-only-L dayzero`, else the linker's default paths.
use std::env;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=DAYZERO_LIB_DIR");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    if let Ok(dir) = env::var("DAYZERO_LIB_DIR") {
        println!("cargo:rustc-link-search=native={}", dir);
    } else if let Ok(out) = Command::new("pkg-config")
        .args(["--libs-only-L", "dayzero"])
        .output()
    {
        if out.status.success() {
            for flag in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                if let Some(dir) = flag.strip_prefix("-L") {
                    println!("cargo:rustc-link-search=native={}", dir);
                }
            }
        }
    }
    println!("cargo:rustc-link-lib=dylib=dayzero");
}
