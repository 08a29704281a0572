//! `strftime` of a UTC unix time, as chat templates (`strftime_now`) and Harmony's system
//! message date use it.

use minijinja::{Error, ErrorKind};

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];

/// `strftime` of a UTC unix time (the directives chat templates use).
pub(crate) fn strftime(format: &str, unix: i64) -> Result<String, Error> {
    let days = unix.div_euclid(86_400);
    let sod = unix.rem_euclid(86_400);
    // civil_from_days (H. Hinnant)
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_mar = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_mar + 2) / 153;
    let day = doy_mar - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday =
        cum.get(usize::try_from(month - 1).unwrap_or(0)).copied().unwrap_or(0) + day + i64::from(leap && month > 2);
    let weekday = (days + 3).rem_euclid(7); // 1970-01-01 was a Thursday (Monday = 0)
    let (h, m, s) = (sod / 3600, (sod % 3600) / 60, sod % 60);
    let month_name = MONTHS.get(usize::try_from(month - 1).unwrap_or(0)).copied().unwrap_or_default();
    let day_name = DAYS.get(usize::try_from(weekday).unwrap_or(0)).copied().unwrap_or_default();
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut d = chars.next().ok_or_else(|| Error::new(ErrorKind::InvalidOperation, "strftime: trailing %"))?;
        let unpadded = d == '-';
        if unpadded {
            d = chars.next().ok_or_else(|| Error::new(ErrorKind::InvalidOperation, "strftime: trailing %-"))?;
        }
        let num = |n: i64, width: usize| if unpadded { n.to_string() } else { format!("{n:0width$}") };
        let piece = match d {
            'Y' => year.to_string(),
            'y' => num(year % 100, 2),
            'm' => num(month, 2),
            'd' => num(day, 2),
            'e' => format!("{day:>2}"),
            'j' => num(yday, 3),
            'H' => num(h, 2),
            'I' => num(if h % 12 == 0 { 12 } else { h % 12 }, 2),
            'M' => num(m, 2),
            'S' => num(s, 2),
            'p' => (if h < 12 { "AM" } else { "PM" }).to_string(),
            'B' => month_name.to_string(),
            'b' | 'h' => month_name.get(..3).unwrap_or_default().to_string(),
            'A' => day_name.to_string(),
            'a' => day_name.get(..3).unwrap_or_default().to_string(),
            'F' => format!("{year}-{month:02}-{day:02}"),
            'T' => format!("{h:02}:{m:02}:{s:02}"),
            '%' => "%".to_string(),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("strftime directive %{other} not supported"),
                ))
            }
        };
        out.push_str(&piece);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_formats_utc_dates() {
        // 2024-02-29 13:05:09 UTC, a Thursday
        let t = 1_709_211_909;
        assert_eq!(
            strftime("%d %b %Y %H:%M:%S %A %j %-d %B %y %p %I", t).unwrap(),
            "29 Feb 2024 13:05:09 Thursday 060 29 February 24 PM 01"
        );
        assert!(strftime("%Z", t).is_err());
    }
}
